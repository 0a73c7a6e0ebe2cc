"""loom's attention kernels for Hopper (sm_90) in Gluon, warp-specialized as in FlashAttention-3: a one-warp
producer loads blocks by TMA into a ring of slots, consumer warpgroups run the matmuls asynchronously and release
each slot through an mbarrier. One module per kernel (``forward``, ``dq``, ``dkdv``), what they share (``common``)
and their launchers (``launch``); design and measurements: docs/kernels.md."""
