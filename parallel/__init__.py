"""fedpar.parallel: the training engine on torch.distributed (DDP, FSDP2/HSDP, TP/SP, PP, DCP checkpoints).

Parallelisms are plain functions over a model, composed in torchtitan's order by ``parallelize``:
pipeline split (pp.py) -> tensor/sequence parallel (tp.py) -> activation checkpointing -> torch.compile
per block (compile.py) -> FSDP/HSDP (fsdp.py) or DDP (ddp.py). ``config.py`` holds the settings, ``init.py``
the process group and the local launcher, ``mesh.py`` the named DeviceMesh, ``checkpoint.py`` DCP
save/resume and full-state-dict helpers for large-model FL clients, ``sampler.py`` the distributed sampler,
``trainer.py`` the loop behind ``fedpar train``. Submodules are imported on demand (torch.distributed
imports are slow).
"""
