"""Fingerprints: any single changed element and any swap of two different elements is seen."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx.verify.fingerprint import SMALL, FingerprintStore, fingerprint_parts
from tests.helpers import TENSOR_DTYPES

#: Element counts that reach every path: a last partial word, a copy of the words, a table
#: whose rows are all full, a table with words past its last row, and both at once.
NUMELS = {
    "empty": 0,
    "one": 1,
    "partial word": 3,
    "copied": 100,
    "table": 2048,
    "table and rest": 3 * 1024 + 17,
    "larger": 40_000 + 5,
}


def host(t: torch.Tensor) -> bytes:
    parts = fingerprint_parts(t)
    assert parts is not None
    assert all(p.dtype == torch.int64 and p.dim() == 1 and p.device == t.device for p in parts)
    return b"".join(p.cpu().numpy().tobytes() for p in parts)


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bits (NaNs with any payload, signed zeros, ...), viewed as ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw % 2 == 1  # only 0 and 1 are valid bools
    return raw.view(dtype)


def changed(a: torch.Tensor, i: int) -> torch.Tensor:
    """``a`` with element ``i`` changed: another bool, or one more in its first byte."""
    b = a.clone()
    if a.dtype == torch.bool:
        b[i] = ~a[i]
    else:
        b.view(torch.uint8)[i * a.element_size()] += 1  # wraps within the byte
    return b


def test_small_tensors_are_copied_and_large_ones_summed():
    assert [p.numel() for p in fingerprint_parts(torch.zeros(2 * SMALL))] == [SMALL]
    # 3000 float64: 46 rows of 65 words (an odd number), then 10 more words.
    parts = fingerprint_parts(torch.zeros(3000, dtype=torch.float64))
    assert [p.numel() for p in parts] == [46, 65, 10]
    # complex128: rows of 33 elements, one row sum per word of an element.
    parts = fingerprint_parts(torch.zeros(1024, dtype=torch.complex128))
    assert [p.numel() for p in parts] == [31 * 2, 66, 2]
    assert fingerprint_parts(torch.zeros(0)) == []
    assert fingerprint_parts(torch.empty(3, device="meta")) is None


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS.values(), ids=NUMELS.keys())
def test_any_single_change_is_seen(dtype, numel):
    a = random_tensor(dtype, numel, seed=numel)
    assert host(a) == host(a.clone())
    for position in sorted({0, 1, numel // 2, numel - 8, numel - 2, numel - 1} & set(range(numel))):
        assert host(a) != host(changed(a, position)), position


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [3, 100, 3 * 1024 + 17], ids=["partial word", "copied", "table"])
def test_any_swap_of_two_different_elements_is_seen(dtype, numel):
    a = random_tensor(dtype, numel, seed=1)
    if dtype == torch.bool:
        a = torch.arange(numel) % 3 == 0
    pairs = {(0, 1), (0, numel - 1), (1, numel - 2), (numel // 2, numel // 2 + 1)}
    if numel > 2048:
        # Same row, same column, neither, within the words past the table, table and rest.
        pairs |= {(5, 37), (5, 5 + 64), (5, 1000), (numel - 9, numel - 3), (17, numel - 5)}
    for i, j in sorted(pairs):
        if torch.equal(a[i : i + 1].view(torch.uint8), a[j : j + 1].view(torch.uint8)):
            continue
        b = a.clone()
        b[[i, j]] = a[[j, i]]
        assert host(a) != host(b), (i, j)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_signs_of_zero_nan_payloads_and_x_traded_for_minus_x(dtype):
    zeros = torch.zeros(3000, dtype=dtype)
    signed = zeros.clone()
    signed[1234] = -0.0
    assert host(zeros) != host(signed)
    nan = torch.full((3000,), float("nan"), dtype=dtype)
    other = nan.clone()
    other.view(torch.uint8)[0] ^= 1  # another payload, still a NaN
    assert bool(other.isnan().all()) and host(nan) != host(other)
    # x and -x (also 0.0 and -0.0) trading places: they differ only in the sign bit, the case
    # that two 64-bit sums, one plain and one weighted by position, cannot always see.
    x = torch.linspace(1, 2, 3000, dtype=dtype)
    for i, j in ((0, 2), (1, 3), (3, 3 + 64 * 4), (10, 2000)):
        for values in ((x[i], -x[i]), (0.0, -0.0)):
            a = x.clone()
            a[i], a[j] = values
            b = x.clone()
            b[i], b[j] = reversed(values)
            assert host(a) != host(b), (i, j, values)


def test_reordered_values_are_seen():
    a = torch.arange(2 * 1024 + 5, dtype=torch.float32)
    shuffled = a[torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))]
    for moved in (torch.roll(a, 1), a.flip(0), shuffled):
        assert host(moved) != host(a)


FLOATS = [d for d in TENSOR_DTYPES if d.is_floating_point or d.is_complex]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("numel", NUMELS.values(), ids=NUMELS.keys())
def test_a_sign_flip_of_every_element_is_seen(dtype, numel):
    if numel == 0:
        return
    a = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    if dtype.is_complex:
        a = torch.complex(a.real, a.real.flip(0)).to(dtype)
        assert host(a) != host(a.conj().resolve_conj())
    assert host(a) != host(-a)
    assert host(a.abs()) != host(-a.abs())


def test_complex128_elements_negated_or_with_parts_traded():
    a = torch.complex(torch.linspace(1, 2, 2000), torch.linspace(3, 4, 2000)).to(torch.complex128)
    negated = a.clone()
    negated[700] = -negated[700]
    assert host(a) != host(negated)
    b = a.clone()
    b[5], b[5 + 64] = complex(1.0, 2.0), complex(2.0, 1.0)  # same column pair, different rows
    c = a.clone()
    c[5], c[5 + 64] = complex(2.0, 1.0), complex(1.0, 2.0)
    assert host(b) != host(c)


def test_fingerprint_sees_values_not_layout():
    a = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert host(a.t()) == host(a.t().contiguous())
    assert host(a[:, ::2]) == host(a[:, ::2].contiguous())
    assert host(a.view(-1)[1:]) == host(a.view(-1)[1:].clone())  # storage offset of 4 bytes
    c = torch.complex(a, a)
    assert host(c.conj()) == host(c.conj().resolve_conj())
    assert host(c.conj()) != host(c)
    assert host(c.conj().imag) == host(-a)  # a negative view (the neg bit)
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors: still seen
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(a, 0.1, 0, torch.qint8)
    assert host(q) == host(q.int_repr())
    s = a.relu().to_sparse()
    assert host(s) == host(s.to_dense())


def test_a_backend_without_strides_gets_the_same_fingerprint(monkeypatch):
    tensors = [random_tensor(dtype, NUMELS["table and rest"], seed=2) for dtype in TENSOR_DTYPES]
    strided = [host(t) for t in tensors]

    def no_strides(*args, **kwargs):
        raise NotImplementedError("as_strided")

    monkeypatch.setattr(torch.Tensor, "as_strided", no_strides)
    assert [host(t) for t in tensors] == strided


def test_fingerprint_does_not_depend_on_the_thread_count():
    a = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).view(torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = host(a)
        torch.set_num_threads(max(2, threads))
        assert host(a) == one
    finally:
        torch.set_num_threads(threads)


def test_fingerprint_of_a_tensor_that_requires_grad_records_no_graph():
    w = torch.randn(3000, generator=torch.Generator().manual_seed(0)).requires_grad_()
    parts = fingerprint_parts(w * 2)
    assert parts and all(p.grad_fn is None and not p.requires_grad for p in parts)


# --- the law, for any dtype, length and place ---------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Any dtype; 1 to 6000 elements, as a scalar, a vector or a matrix (rows of any size)."""
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    rows = draw(st.integers(1, 5))
    columns = draw(st.one_of(st.integers(1, 40), st.integers(1, 1200)))
    t = random_tensor(dtype, rows * columns, seed=draw(st.integers(0, 2**32 - 1)))
    shape = draw(st.sampled_from([(rows * columns,), (rows, columns), (rows * columns, 1)]))
    if rows * columns == 1 and draw(st.booleans()):
        shape = ()
    return t.reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(a=tensors(), data=st.data())
def test_changing_any_one_element_changes_the_fingerprint(a, data):
    i = data.draw(st.integers(0, a.numel() - 1), label="index")
    size = a.element_size()
    new = data.draw(st.binary(min_size=size, max_size=size), label="new bits")
    flat = a.reshape(-1).clone()
    if a.dtype == torch.bool:
        flat[i] = ~flat[i]
    else:
        raw = flat.view(torch.uint8)
        raw[i * size : (i + 1) * size] = torch.tensor(list(new), dtype=torch.uint8)
    b = flat.reshape(a.shape)
    assert (host(a) == host(b)) == same_bits(a, b)


@settings(max_examples=200, deadline=None)
@given(a=tensors(), data=st.data())
def test_swapping_any_two_elements_changes_the_fingerprint_unless_they_are_equal(a, data):
    i = data.draw(st.integers(0, a.numel() - 1), label="i")
    j = data.draw(st.integers(0, a.numel() - 1), label="j")
    flat = a.reshape(-1).clone()
    if data.draw(st.booleans(), label="x and -x") and (a.is_floating_point() or a.is_complex()):
        flat[j] = -flat[i]
    a = flat.reshape(a.shape)
    swapped = flat.clone()
    swapped[[i, j]] = flat[[j, i]]
    b = swapped.reshape(a.shape)
    assert (host(a) == host(b)) == same_bits(a, b)


# --- many tensors at once -------------------------------------------------------------------------


@st.composite
def many(draw: st.DrawFn) -> list[torch.Tensor]:
    """Tensors of every kind a run fingerprints: any dtype and length (copied or summed, with
    or without words past the table), transposed, negative and conjugate views, an odd
    start, empty and meta tensors."""
    found = []
    for _ in range(draw(st.integers(0, 6))):
        t = draw(tensors())
        kind = draw(st.sampled_from(["plain", "plain", "transposed", "neg", "start", "empty"]))
        if kind == "transposed" and t.dim() == 2:
            t = t.t()
        elif kind == "neg" and t.is_complex():
            t = t.conj() if draw(st.booleans()) else t.conj().imag
        elif kind == "start" and t.numel() > 1:
            t = t.reshape(-1)[1:]  # a storage offset that is not a whole word
        elif kind == "empty":
            t = t.reshape(-1)[:0]
        found.append(t)
    if draw(st.booleans()):
        found.insert(draw(st.integers(0, len(found))), torch.empty(3, device="meta"))
    return found


def stored(store: FingerprintStore, slots: list) -> list[bytes | None]:
    data = store.host()
    return [None if s is None else data[s[0]][s[1] : s[2]] for s in slots]


@settings(max_examples=200, deadline=None)
@given(first=many(), then=many())
def test_add_all_keeps_the_fingerprints_add_keeps(first, then):
    one_by_one = FingerprintStore()
    expected = stored(one_by_one, [one_by_one.add(t) for t in first + then])
    assert expected == [None if t.is_meta else host(t) for t in first + then]
    # After some single ones, in the same store: the slots go on where they stopped.
    mixed = FingerprintStore()
    slots = [mixed.add(t) for t in first] + mixed.add_all(then)
    assert stored(mixed, slots) == expected
    together = FingerprintStore()
    assert stored(together, together.add_all(first + then)) == expected


def test_add_all_copies_before_returning():
    a = torch.arange(3000.0)
    small = torch.arange(10.0)
    store = FingerprintStore()
    slots = store.add_all([a, small])
    before = [host(a), host(small)]
    a.zero_(), small.zero_()  # the words copied as they are: the tail of a, all of small
    assert stored(store, slots) == before


# --- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.backends.cuda.is_built() or not torch.cuda.is_available(), reason="needs CUDA"
)
@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
def test_fingerprint_on_cuda_equals_cpu_and_stays_on_device(dtype):
    for numel in NUMELS.values():
        a = random_tensor(dtype, numel, seed=numel)
        assert host(a.cuda()) == host(a)  # host() checks that the parts stay on the device


def test_one_element_with_another_stride_is_fingerprinted():
    """``c.conj().imag`` of one complex element: contiguous for torch (a size-1 dimension's
    stride does not count), but of stride 2, which a dtype view refuses (found by Hypothesis
    in ``test_add_all_keeps_the_fingerprints_add_keeps``: it fingerprinted as ``None``)."""
    t = torch.tensor([1 + 3.5e24j], dtype=torch.complex64).conj().imag
    assert t.stride() == (2,) and t.is_neg()
    assert host(t) == host(t.clone(memory_format=torch.contiguous_format))
