"""Stand-in: the engine's workspace manager does not exist here."""


def current_workspace_manager():
    raise RuntimeError("no vLLM workspace manager in a staged kernel folder")
