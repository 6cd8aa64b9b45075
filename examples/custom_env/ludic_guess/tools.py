"""The ``bisect`` tool: an agent may ask for the middle of an interval instead of computing
it (a plain function: its typed signature is the tool's JSON schema)."""


def bisect(low: int, high: int) -> int:
    """The middle of the interval [low, high], rounded down."""
    if low > high:
        raise ValueError(f"empty interval: low={low} > high={high}")
    return (low + high) // 2
