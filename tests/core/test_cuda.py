"""CUDA only: zero-copy UVA views, and pools that never overwrite a buffer in flight."""

from __future__ import annotations

import ctypes

import pytest
import torch

from cp_blocktables import BlockTables, BlockTablesConfig, UvaBackedTensor, UvaBufferPool, guards
from cp_blocktables.reference import ReferenceBlockTables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _host_device_pointer(host_ptr: int) -> int:
    """cudaHostGetDevicePointer through whichever binding the machine has."""
    try:
        from cuda.bindings import runtime

        err, dev_ptr = runtime.cudaHostGetDevicePointer(host_ptr, 0)
        assert int(err) == 0, err
        return int(dev_ptr)
    except ImportError:
        pass
    lib = ctypes.CDLL("libcudart.so", mode=ctypes.RTLD_GLOBAL)
    dev_ptr = ctypes.c_void_p()
    assert lib.cudaHostGetDevicePointer(ctypes.byref(dev_ptr), ctypes.c_void_p(host_ptr), 0) == 0
    return dev_ptr.value


def test_view_address_is_the_pinned_buffers_device_address():
    t = UvaBackedTensor((4, 8), torch.int32, device="cuda")
    buf = t.pool._buffers[(t.pool._next - 1) % t.pool.max_concurrency]
    assert buf.cpu.is_pinned()
    assert t.gpu.is_cuda
    assert t.gpu.data_ptr() == buf.cpu.data_ptr() == _host_device_pointer(buf.cpu.data_ptr())


def test_publish_launches_no_copy_and_kernels_see_host_writes():
    bt = BlockTables([4], 2, 8, [4], torch.device("cuda"))
    bt.append_block_ids(0, ([5, 6, 7],), False)
    bt.apply_staged_writes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        bt.num_blocks.copy_to_uva()
        torch.cuda.synchronize()
    assert not [e for e in prof.events() if "Memcpy" in e.name or "memcpy" in e.name]
    # A host write after publishing, with no copy, reaches the next kernel.
    host = bt.num_blocks.pool._buffers[(bt.num_blocks.pool._next - 1) % 2]
    assert host.dev.data_ptr() == bt.num_blocks.gpu.data_ptr()
    host.np[0, 0] = 2
    out = bt.gather_block_tables(torch.tensor([0], dtype=torch.int32, device="cuda"), 1)
    assert out[0][0, :3].tolist() == [5, 6, 0]


@pytest.mark.parametrize("shape", [(1, 1), (0, 4), (2, 3)], ids=["one-element", "empty", "small"])
def test_uva_views_of_any_size_alias_their_host_buffer(shape):
    """Sizes at the edges: one group of one row (a single element) must alias like any other;
    an empty buffer (zero groups) has nothing to alias and must still publish."""
    t = UvaBackedTensor(shape, torch.int32, device="cuda")
    t.np[...] = 7
    t.copy_to_uva()
    assert t.gpu.is_cuda and tuple(t.gpu.shape) == shape
    buf = t.pool._buffers[(t.pool._next - 1) % t.pool.max_concurrency]
    if t.np.size:
        assert t.gpu.data_ptr() == buf.cpu.data_ptr()
        buf.np[...] = 9  # no copy: the device sees the host write
        assert int(t.gpu.sum()) == 9 * t.np.size


def test_one_group_of_one_row_gathers_what_was_published():
    bt = BlockTables([4], 1, 8, [4], torch.device("cuda"))
    bt.append_block_ids(0, ([5, 6],), False)
    bt.apply_staged_writes()
    out = bt.gather_block_tables(torch.tensor([0], dtype=torch.int32, device="cuda"), 1)
    assert out[0][0, :3].tolist() == [5, 6, 0]


@pytest.mark.parametrize(
    ("max_concurrency", "publishes"),
    [(2, 1), (1, 1), (2, 3), (3, 5)],
    ids=["round-robin", "single-buffer-waits", "host-ahead-waits", "host-far-ahead-waits"],
)
def test_a_buffer_is_never_reused_while_the_device_may_read_it(max_concurrency, publishes):
    """A kernel queued behind a long one still reads step 1's value however many steps
    the host publishes meanwhile (SPEC.md section 4): past `max_concurrency` the pool
    waits for step 1's reader instead of overwriting its buffer."""
    pool = UvaBufferPool(1024, torch.int64, max_concurrency=max_concurrency, device="cuda")
    out = torch.zeros(1024, dtype=torch.int64, device="cuda")
    step1 = pool.copy_to_uva([1] * 1024)
    torch.cuda._sleep(50_000_000)  # keep the stream busy while the host moves on
    out.copy_(step1, non_blocking=True)
    for step in range(publishes):
        pool.copy_to_uva([2 + step] * 1024)
    torch.cuda.synchronize()
    assert out.unique().tolist() == [1]


def test_slot_mappings_replay_from_a_cuda_graph():
    """On CUDA the call is capturable: a replay after new positions gives their slots."""
    kwargs = dict(
        block_sizes=[16, 32],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8, 4],
        cp_size=2,
        cp_rank=1,
        cp_interleave=4,
    )
    bt = BlockTables(device=torch.device("cuda"), **kwargs)
    ref = ReferenceBlockTables(BlockTablesConfig(**kwargs))
    for t in (bt, ref):
        t.append_block_ids(2, ([3, 4, 5], [6, 7]), True)
    bt.apply_staged_writes()
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    pos = torch.arange(8, dtype=torch.int64, device="cuda")
    bt.compute_slot_mappings(idx, qsl, pos, 8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bt.compute_slot_mappings(idx, qsl, pos, 8)
    pos.copy_(torch.arange(40, 48, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.slot_mappings([2], [0, 8], list(range(40, 48)), 64)
    assert bt.slot_mappings.cpu().tolist() == expected.tolist()


def _gpu_gib() -> float:
    return (
        torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0
    )


@pytest.mark.skipif(_gpu_gib() < 40, reason="needs 40 GiB of GPU memory")
def test_a_step_of_2_30_tokens_maps_its_last_tile_to_its_own_entries():
    """The token cap, 2**30 (docs/contract-notes.md), is inclusive. At the cap the tile
    layout's searches for a tile's first and last entry run within one tile of int32's
    top: the last tile must still give each token its own entry's slot, and PAD past the
    batch. Two requests end in the last tile; the step is far too large for the
    interpreter, so only a GPU reaches it."""
    n = 2**30
    kwargs = dict(
        block_sizes=[16], max_num_reqs=2, max_num_batched_tokens=n, max_num_blocks_per_group=[4]
    )
    bt = BlockTables(device=torch.device("cuda"), **kwargs)
    ref = ReferenceBlockTables(BlockTablesConfig(**kwargs))
    for t in (bt, ref):
        t.append_block_ids(0, ([3, 4, 5, 6],), True)
        t.append_block_ids(1, ([7, 8, 9, 10],), True)
    bt.apply_staged_writes()
    qsl = [0, n - 100, n - 50]
    on = dict(device="cuda", dtype=torch.int32)
    positions = torch.arange(n, device="cuda").remainder_(64)  # [n], every row's 64 positions
    slots = bt.compute_slot_mappings(
        torch.tensor([0, 1], **on), torch.tensor(qsl, **on), positions, n
    )  # [1, n]
    tail = 512  # the last tile on a GPU: entry 0's last 412 tokens, entry 1, 50 past the batch
    expected_tail = ref.slot_mappings(
        [0, 1], [0, tail - 100, tail - 50], positions[-tail:].cpu(), tail
    )
    assert slots[0, -tail:].cpu().tolist() == expected_tail[0].tolist()
    # Before the tail every token is entry 0's: its slot is the reference's for its position.
    by_position = torch.from_numpy(ref.slot_mappings([0], [0, 64], list(range(64)), 64)[0])
    head = slots[0, : n - tail]
    assert torch.equal(head, by_position.cuda()[positions[: n - tail]])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tables_on_a_device_that_is_not_current():
    """Triton launches on the current device; BlockTables on cuda:1 must still work."""
    torch.cuda.set_device(0)
    bt = BlockTables([4, 8], 2, 8, [4, 4], torch.device("cuda", 1))
    bt.append_block_ids(1, ([5, 6], [7]), True)
    bt.apply_staged_writes()
    on = dict(device="cuda:1", dtype=torch.int32)
    slots = bt.compute_slot_mappings(
        torch.tensor([1], **on),
        torch.tensor([0, 2], **on),
        torch.tensor([0, 5], device="cuda:1"),
        2,
    )
    assert slots.tolist() == [[20, 25], [56, 61]]
    assert bt.gather_block_tables(torch.tensor([1], **on), 1)[0][0, :2].tolist() == [5, 6]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize(
    "device, current",
    [(torch.device("cuda", 1), 0), (torch.device("cuda"), 1)],
    ids=["cuda:1-while-cuda:0-is-current", "bare-cuda-while-cuda:1-is-current"],
)
def test_caller_outputs_on_the_instances_gpu_are_taken(device, current):
    """Caller-owned `out` tables and slot buffers on the instance's GPU are taken: on
    `cuda:1` whichever device is current (the harness's rank 1 under NCCL), and on `cuda`
    without an index, which is the current device, here cuda:1."""
    torch.cuda.set_device(current)
    try:
        bt = BlockTables([4, 8], 2, 8, [4, 4], device)
        bt.append_block_ids(1, ([5, 6], [7]), True)
        bt.apply_staged_writes()
        on = dict(device="cuda:1", dtype=torch.int32)
        idx = torch.tensor([1], **on)
        out = torch.full((2, 8), 77, dtype=torch.int64, device="cuda:1")
        slots = bt.compute_slot_mappings(
            idx, torch.tensor([0, 2], **on), torch.tensor([0, 5], device="cuda:1"), 2, out=out
        )
        assert slots.data_ptr() == out.data_ptr()
        assert slots.tolist() == [[20, 25], [56, 61]]
        tables = [torch.zeros((1, 4), **on), torch.zeros((1, 4), **on)]
        got = bt.gather_block_tables(idx, 1, out=tables)
        assert [t[0].tolist() for t in got] == [[5, 6, 0, 0], [7, 0, 0, 0]]
    finally:
        torch.cuda.set_device(0)


def test_integrity_counts_reach_the_device_without_a_synchronisation():
    """`integrity._to_device` copies the host counts from pinned memory, non-blocking: under
    torch's sync debug mode a pageable (synchronous) copy would raise."""
    from cp_blocktables import integrity

    torch.cuda.set_sync_debug_mode("error")
    try:
        t = integrity._to_device([[1, 2, 3]], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.is_cuda and t.cpu().tolist() == [[1, 2, 3]]


def test_verified_address_tensors_are_not_read_again(monkeypatch):
    """The guards' module doc: a CUDA pointer tensor verified once is remembered with its
    version and values, so checking the same tensors again (two, as `FusedStagedWriter`
    checks pointers and strides) reads neither of them: no synchronisation."""
    monkeypatch.setattr(guards, "_verified", {})  # not near its limit from earlier tests
    cuda = torch.device("cuda")
    wants = [[0x1000, 0x2000], [8, 4]]
    tensors = [torch.tensor(w, dtype=torch.int64, device=cuda) for w in wants]
    for t, w in zip(tensors, wants):
        guards.check_address_tensor(t, w, "ptrs", "want[{i}]", cuda)  # read and remembered
    torch.cuda.set_sync_debug_mode("error")  # a host read of a CUDA tensor now raises
    try:
        for t, w in zip(tensors, wants):
            guards.check_address_tensor(t, w, "ptrs", "want[{i}]", cuda)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("rewritten-in-place", r"ptrs\[1\] = 0x3000 but want\[1\] is 0x2000"),
        ("destinations-moved", r"ptrs\[1\] = 0x2000 but want\[1\] is 0x3000"),
        ("destinations-moved-down", r"ptrs\[1\] = 0x2000 but want\[1\] is 0x800"),
    ],
    ids=["rewritten-in-place", "destinations-moved", "destinations-moved-down"],
)
def test_a_remembered_address_tensor_is_read_again_once_it_or_its_destinations_change(
    monkeypatch, change, message
):
    """The guards' module doc: a remembered CUDA pointer tensor is read again when it was
    written in place through torch (its `_version` moved) or its destinations moved (up or
    down: the remembered values must equal the new ones, not merely sort past them), so a
    value that no longer matches is refused as on the first check, not trusted."""
    monkeypatch.setattr(guards, "_verified", {})
    cuda = torch.device("cuda")
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64, device=cuda)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    if change == "rewritten-in-place":
        t[1] = 0x3000
    elif change == "destinations-moved":
        want = [0x1000, 0x3000]
    else:  # the remembered values sort above the new ones
        want = [0x1000, 0x800]
    with pytest.raises(ValueError, match=message):
        guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)


def test_host_pointer_checks_do_not_evict_verified_cuda_tensors(monkeypatch):
    """Only CUDA pointer tensors are remembered: checking more host tensors than the cache
    holds (a CPU `BlockTables` beside a CUDA one, SPEC.md 5) leaves a verified CUDA tensor
    remembered, so checking it again reads nothing: no synchronisation."""
    monkeypatch.setattr(guards, "_verified", {})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64, device=cuda)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    host = [torch.tensor([i], dtype=torch.int64) for i in range(guards._CACHE_LIMIT)]
    for i, h in enumerate(host):
        guards.check_address_tensor(h, [i], "ptrs", "want[{i}]", cpu)
    torch.cuda.set_sync_debug_mode("error")  # a host read of a CUDA tensor now raises
    try:
        guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_remembered_address_tensors_fill_the_cache_but_never_pass_its_limit(monkeypatch):
    """The cache of verified CUDA pointer tensors grows to 64 entries (`_CACHE_LIMIT`), no
    more: the 65th clears it before it is stored."""
    monkeypatch.setattr(guards, "_verified", {})
    cuda = torch.device("cuda")
    tensors = [torch.tensor([i], dtype=torch.int64, device=cuda) for i in range(130)]
    sizes = []
    for i, t in enumerate(tensors):
        guards.check_address_tensor(t, [i], "ptrs", "want[{i}]", cuda)
        sizes.append(len(guards._verified))
    assert sizes == [*range(1, 65), *range(1, 65), 1, 2]
