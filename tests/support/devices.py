"""Device options the tests share."""

# Several aggregator ranks of `fedpar serve` on this machine's CPU with gloo: on a GPU, NCCL takes one GPU per rank,
# and serve refuses more local ranks than GPUs (the GPU box has one).
RANKS_ON_CPU = ("--device", "cpu")
