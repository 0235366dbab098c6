"""Pairwise covering arrays: few rows in which every pair of values of every two factors meets.

A greedy construction in the manner of AETG (Cohen et al., 1997), made deterministic: each row is
seeded with the first pair not yet covered (factors and values in the order given), and every
other factor, the factors with more values first, takes the value that covers the most new pairs
with the factors already set (the first such value on a tie). Pairs the caller forbids (values
that cannot run together) are never put in a row, so every row is allowed.

For the combination test's space (values 6 x 5 x 4 x 3 x 2^5) this gives 32 rows where the product
has 23,040; 30 (6 x 5, the two largest factors) is the least any array can have.
"""
from __future__ import annotations

import itertools

Pair = tuple[tuple[str, object], tuple[str, object]]


def _pair(a: tuple[str, object], b: tuple[str, object], order: dict[str, int]) -> Pair:
    return (a, b) if order[a[0]] < order[b[0]] else (b, a)


def all_pairs(factors: dict[str, list], forbidden: set[Pair] = frozenset()) -> list[Pair]:
    """Every pair of values of two different factors, factors in the order given, less `forbidden`
    (pairs in that same order)."""
    names = list(factors)
    return [((f, a), (g, b)) for f, g in itertools.combinations(names, 2)
            for a in factors[f] for b in factors[g] if ((f, a), (g, b)) not in forbidden]


def _new_pairs(row: dict, name: str, value, uncovered: set[Pair], forbidden: set[Pair],
               order: dict[str, int]) -> int | None:
    """Pairs `name = value` would newly cover with the factors set in `row`; None if it would make
    a forbidden pair (one all_pairs left out: neither covered nor to be covered)."""
    count = 0
    for other, chosen in row.items():
        pair = _pair((name, value), (other, chosen), order)
        if pair in uncovered:
            count += 1
        elif pair in forbidden:
            return None
    return count


def pairwise(factors: dict[str, list], forbidden: set[Pair] = frozenset()) -> list[dict]:
    """Rows (dicts factor -> value) that together hold every allowed pair; none holds a forbidden
    one. Deterministic: the same factors give the same rows."""
    order = {name: i for i, name in enumerate(factors)}
    forbidden = {_pair(a, b, order) for a, b in forbidden}
    uncovered = set(all_pairs(factors, forbidden))
    remaining = all_pairs(factors, forbidden)          # the seeds, in a fixed order
    by_size = sorted(factors, key=lambda name: (-len(factors[name]), order[name]))
    rows = []
    while uncovered:
        seed = next(p for p in remaining if p in uncovered)
        row = dict(seed)
        for name in by_size:
            if name in row:
                continue
            scores = [(_new_pairs(row, name, v, uncovered, forbidden, order), -i) for i, v in enumerate(factors[name])]
            best = max((s for s in scores if s[0] is not None), default=None)
            if best is None:
                raise ValueError(f"no value of {name} is allowed with {row}")
            row[name] = factors[name][-best[1]]
        uncovered -= {_pair(a, b, order) for a, b in itertools.combinations(row.items(), 2)}
        rows.append({name: row[name] for name in factors})
    return rows


def product(factors: dict[str, list], forbidden: set[Pair] = frozenset()) -> list[dict]:
    """Every combination without a forbidden pair."""
    order = {name: i for i, name in enumerate(factors)}
    forbidden = {_pair(a, b, order) for a, b in forbidden}
    rows = (dict(zip(factors, values)) for values in itertools.product(*factors.values()))
    return [row for row in rows
            if not any(_pair(a, b, order) in forbidden for a, b in itertools.combinations(row.items(), 2))]
