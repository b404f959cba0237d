"""What CUDA's kernels and engine do that meta tensors do not: the kernel rules (`rules`: workspaces,
scratch buffers, CUDA's autocast; `cuda`: cuBLAS's workspaces and the kernels' own buffers; `sdpa`: which
attention kernel runs and what it keeps), the CUDA paths of Triton wrappers (`paths`), bitsandbytes' fake
kernels (`bnb`), the gradient scaler (`scaler`) and autograd's in-place gradient accumulation
(`accumulation`)."""
