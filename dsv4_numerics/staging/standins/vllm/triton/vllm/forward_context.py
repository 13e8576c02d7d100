"""Stand-in: there is no forward context outside the engine."""


def get_forward_context():
    raise RuntimeError("no vLLM forward context in a staged kernel folder")
