"""Indices and tensors at the edges of int64, shared by the slicing tests of ``get_slice``
(test_safe_open.py), ``parts=`` (test_parts.py) and the lazy tensors (test_lazy.py): steps and
bounds of 2**62 and more, negative ints, ``...`` and ``None``, over small tensors with data and
tensors of no element whose other dims are 2**62 (a header may say so: ``(0, 2**62, 2**62)``,
whose contiguous strides overflow int64, though there is nothing to stride over).

:func:`expected_shape` is the oracle: a basic index's result shape by Python's own ``range``
arithmetic (torch clamps slice bounds as Python does), an ``IndexError`` for an int out of range
or too many indices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

H = 2**62
I64 = 2**63 - 1

# Tensors of no element, with dims of 2**62 (written by safetensors' own writer from a header
# alone: torch cannot make most of them); small ones with data are drawn by the tests.
EMPTY_HUGE = [(0, H, H), (H, 0, H), (0, H), (H, 0), (3, 0, H), (0,)]
SMALL = [(4, 3), (5, 2, 3), (7,), (2, 1, 4)]

# The edge tests' settings (with their own max_examples): each example reads files, and the
# files are a module's fixture.
EDGE_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def edge_files(tmp_path_factory):
    """One file per shape above: small tensors with data, tensors of no element with dims of
    2**62 (safetensors' writer, from the header alone). Bound in each module that uses it."""
    return write_edge_files(tmp_path_factory.mktemp("edges"))


_INTS = [0, 1, 2, -1, -2, 5, H - 1, H, -H, I64, -I64 - 1]
_BOUNDS = [None, 0, 1, -1, 4, H, -H, I64, -I64 - 1, 2**64]
_STEPS = [None, 1, 2, 3, H, I64, 2**64]


def _item(n: int):
    small = st.integers(-n - 1, n) if n < 8 else st.sampled_from([0, 1, n - 1, -1])
    return st.one_of(
        st.sampled_from(_INTS),
        small,
        st.builds(
            slice, st.sampled_from(_BOUNDS), st.sampled_from(_BOUNDS), st.sampled_from(_STEPS)
        ),
    )


@st.composite
def huge_indices(draw, shape: tuple[int, ...], with_none: bool = True):
    """A basic index of a tensor of ``shape`` with values at the edges of int64 (steps >= 1):
    up to one entry per dim, maybe a ``...``, maybe ``None``s (``with_none``)."""
    k = draw(st.integers(0, len(shape)))
    items: list = [draw(_item(n)) for n in shape[:k]]
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), Ellipsis)
    if with_none and draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), None)
    if len(items) == 1 and draw(st.booleans()):
        return items[0]
    return tuple(items)


def expected_shape(shape: tuple[int, ...], index) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (see the module's doc)."""
    items = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    if used > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    fill = [slice(None)] * (len(shape) - used)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = fill
    else:
        items += fill
    out, dims = [], iter(shape)
    for it in items:
        if it is None:
            out.append(1)
            continue
        n = next(dims)
        if isinstance(it, slice):
            out.append(len(range(n)[it]))
        elif not -n <= it < n:
            raise IndexError(f"index {it} is out of bounds for a dim of size {n}")
    return tuple(out)


def safe_index(shape: tuple[int, ...], index):
    """``index`` with each slice's bounds clamped and its step at most its dim's size (a step
    past the dim picks one element at most, as the larger one does): torch indexes a tensor
    with it without its overflows near 2**63 (the oracle of the values)."""
    items = index if isinstance(index, tuple) else (index,)
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    sizes = iter(shape)
    out = []
    for it in items:
        if it is Ellipsis:
            for _ in range(len(shape) - used):
                next(sizes)
        elif isinstance(it, slice):
            n = next(sizes)
            start, stop, step = it.indices(n)
            it = slice(start, stop, min(step, max(n, 1)))
        elif it is not None:
            next(sizes)
        out.append(it)
    return tuple(out)


def write_empty(path: Path, shape: tuple[int, ...], dtype: str = "float32") -> Path:
    """A file of one tensor ``t`` of ``shape`` (no element), by safetensors' own writer."""
    import safetensors

    spec = safetensors.TensorSpec(dtype=dtype, shape=list(shape), data_ptr=0, data_len=0)
    safetensors.serialize_file({"t": spec}, str(path))
    return path


def write_edge_files(folder: Path) -> dict[tuple[int, ...], Path]:
    """A file per shape of ``SMALL`` (float32 data) and ``EMPTY_HUGE``, each of one tensor
    ``t``, by safetensors' own writer."""
    import torch
    from helpers import pattern
    from safetensors.torch import save_file

    files = {}
    for i, shape in enumerate(SMALL):
        files[shape] = folder / f"s{i}.safetensors"
        save_file({"t": pattern(shape, torch.float32)}, str(files[shape]))
    for i, shape in enumerate(EMPTY_HUGE):
        files[shape] = write_empty(folder / f"e{i}.safetensors", shape)
    return files
