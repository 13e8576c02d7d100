"""Stand-in for vllm.distributed.parallel_state: GroupCoordinator only as a name (an older release's v1/attention/ops/common.py imports it for its context-parallel helpers, which no staged kernel calls; using it raises)."""


class GroupCoordinator:
    """Placeholder for vLLM's process-group coordinator: the staged kernels never create one."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("vllm.distributed.parallel_state.GroupCoordinator is a dsv4-numerics stand-in: "
                           "the engine's process groups are not staged")
