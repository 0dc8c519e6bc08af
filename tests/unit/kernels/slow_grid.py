"""Parameter grids whose full cross product runs with ``-m slow``: by default each row of the first list meets one
row of the second (row i meets row i mod len(second)), so every value of both lists still runs in the default suite,
once; the other pairs carry the ``slow`` mark (interpreted kernels: each pair costs seconds)."""
import pytest


def rotated_grid(first, second, first_ids=None, second_ids=None):
    """``pytest.param`` rows of ``first`` x ``second`` (each a list of tuples; the test's argnames in that order)."""
    first_ids = first_ids or ["-".join(map(str, a)) for a in first]
    second_ids = second_ids or ["-".join(map(str, b)) for b in second]
    params = []
    for i, a in enumerate(first):
        for j, b in enumerate(second):
            slow = j != i % len(second)
            params.append(pytest.param(*a, *b, id=f"{first_ids[i]}-{second_ids[j]}",
                                       marks=[pytest.mark.slow] if slow else []))
    return params
