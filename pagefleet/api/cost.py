"""Cost per token from a replica's price per hour.

A replica costs the same per hour whatever it serves, so its cost per token is its hourly
price over the tokens it moved in that hour. Each figure charges the whole replica-time to
one kind of token (input or output): they answer "at this throughput, what would 1M
input (or output) tokens have to be priced at to pay for the replicas", the way serving
price lists are derived; they are not shares of one bill and do not add up.
"""

from __future__ import annotations


def cost_per_million_tokens(dollars_per_hour: float, seconds: float, tokens: int) -> float | None:
    """Dollars per 1M ``tokens`` for replicas costing ``dollars_per_hour`` (all of them
    together) over ``seconds``; None when no token moved (the price is unbounded)."""
    if tokens <= 0 or seconds <= 0:
        return None
    return dollars_per_hour * seconds / 3600.0 / tokens * 1e6
