"""Study tools that sit beside the kernels, none of them needed to run the forward pass:

    aot      compile a kernel launch ahead of time for any architecture (sm_80/90/100), no GPU
    sass     disassemble it and report registers, spills, shared memory, matrix instructions
    plans    any kernel's launch built on meta tensors (no memory), at any shape
"""
