"""The ``fedpar`` subcommands: each one's module under ``fedpar.cli`` and its one-line help."""

# subcommand -> module under fedpar.cli that defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "serve": ("serve", "run the coordinator service"),
    "client": ("agent", "run one client agent that dials out to a coordinator"),
    "simulate": ("simulate", "run a coordinator and many agents on this machine"),
    "simulate-workers": ("simulate_workers", "host a slice of a virtual population against a coordinator "
                                             "(one process per torchrun rank)"),
    "train": ("train", "centralized training on the parallel engine (DDP/FSDP/TP/PP)"),
    "certs": ("certs", "make TLS certificates (CA, coordinator, agents), enrollment tokens; revoke agents"),
    "run": ("run", "submit, list, follow, stop and download the runs of a service (fedpar serve --state)"),
    "export": ("export", "write a run's global model (or a checkpoint's) as a torch state_dict file"),
}
