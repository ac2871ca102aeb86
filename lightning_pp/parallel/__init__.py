"""The ranks and what they share: the layout of stages, replicas and tensor-parallel ranks and their process
groups (``topology``), FSDP2 sharding over replicas (``sharding``), gradients across ranks (``grads``), the device and
NCCL's emulation on gloo (``device``, ``nccl_emulation``), and how a failed or preempted job ends on every rank
(``failures``, ``ending``).

May import: ``errors``, ``_compat``."""
