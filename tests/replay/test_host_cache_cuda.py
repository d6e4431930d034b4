"""The streamed replay's host cache on a GPU (replay/load/host_cache.py): slabs page-locked by the fill threads ahead
of the load, each offered tensor copied in on the cache's own stream without waiting, cast to the dtype the passes
compute in where it lies. Compared element by element (a hash of stale bytes verifies)."""

import pytest
import torch

from forensics.replay.load import host_cache
from forensics.replay.load.host_cache import HostBlockCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_offers_are_copied_in_without_waiting_and_hold_the_values_offered(monkeypatch):
    """The offering stream goes on writing the offered tensors right after each offer (a pass writing its weights in
    place; the next tensor reusing the memory): the cache still holds the values offered, in bf16 where asked,
    bitwise the device's cast, and the dump's fp32 values beside them where the capacity had room."""
    monkeypatch.setattr(host_cache, "SLAB", 1 << 20)  # 1 MiB slabs: the fill threads make several
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last device: not a context made on cuda:0
    names = [f"w{i}" for i in range(12)]
    # the even names computed in bf16: their bf16 copies first (9 MiB in all), their fp32 copies in the room left
    cache = HostBlockCache(16 << 20, device, keep={n: torch.bfloat16 for n in names[::2]}, reserve=9 << 20)
    expected, dump_values = {}, {}
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):  # offered from a stream of its own, as the read-ahead worker does
            for name in names:
                values = torch.randn(1 << 18, device=device) * 1e3  # 1 MiB in fp32
                expected[name] = values.to(cache.keep.get(name, torch.float32)).cpu()
                dump_values[name] = values.cpu()
                tensor = torch.empty_like(values)
                torch.cuda._sleep(1 << 22)  # the values land late: a copy not ordered after them would read garbage
                tensor.copy_(values)
                assert cache.offer(name, tensor)
                tensor.fill_(float("nan"))  # a pass writing its weights in place: after the copy, on the device
                del tensor  # its memory handed out again right away (the next empty_like) only once the copy is done
                torch.empty_like(values).fill_(float("nan"))
        cache.settle()
        for name in names:
            dtype = cache.keep.get(name, torch.float32)
            held = cache.get(name, dtype)
            assert held is not None and held.is_pinned()
            on_device = held.to(device, non_blocking=True)  # in the current stream, after the copy in
            assert torch.equal(on_device.cpu().view(torch.uint8), expected[name].view(torch.uint8)), name
            fp32 = cache.get(name, torch.float32).to(device, non_blocking=True)  # the dump's value, for an fp32 pass
            assert torch.equal(fp32.cpu().view(torch.uint8), dump_values[name].view(torch.uint8)), name
    assert cache.held_bytes == 6 * (1 << 19) + 12 * (1 << 20) and cache.dump_value_bytes == 6 << 20
    assert cache.held_bytes <= cache.slab_bytes < cache.held_bytes + (1 << 20)  # the slabs nothing used were freed
    assert cache.fill_span > 0 and cache.fill_seconds > 0 and not cache.refused
    said = cache.describe(12 << 20)
    assert "MiB bfloat16" in said and "(as the passes compute)" in said and "float32 (as the dump holds it)" in said
    assert "page-locked" in said
    slabs = [s[0] for s in cache._slabs]  # kept alive here: their registration is what the thread undoes
    cache.close()  # its slabs unlocked and freed on a thread of their own
    assert len(cache) == 0 and not cache.offer("w0", torch.zeros(1, device=device))
    cache._release.join(timeout=60)
    assert not cache._release.is_alive() and slabs
    cudart = torch.cuda.cudart()
    for slab in slabs:  # no longer registered: registering it again succeeds (an error here is one left set: none)
        assert int(cudart.cudaHostRegister(slab.data_ptr(), slab.numel(), 0)) == 0
        assert int(cudart.cudaHostUnregister(slab.data_ptr())) == 0


def test_when_the_host_refuses_to_lock_more_the_cache_keeps_what_it_holds(monkeypatch):
    """The third slab is refused (as cudaHostRegister and cudaHostAlloc both failing raise): the tensors held so far
    stay and are handed out; later offers are refused, nothing is evicted; the stage log says so."""
    monkeypatch.setattr(host_cache, "SLAB", 1 << 20)
    made = []
    real = host_cache.pinned_slab

    def two_then_refused(size, registered):
        if len(made) >= 2:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        made.append(size)
        return real(size, registered)

    monkeypatch.setattr(host_cache, "pinned_slab", two_then_refused)
    monkeypatch.setattr(host_cache, "FILL_THREADS", 1)  # the slabs in order: the first two made, the third refused
    device = torch.device("cuda", 0)
    cache = HostBlockCache(8 << 20, device)
    values = [torch.randn(1 << 18, device=device) for _ in range(4)]  # 1 MiB each
    kept = [cache.offer(f"w{i}", v) for i, v in enumerate(values)]
    cache.settle()
    assert kept == [True, True, False, False] and cache.refused and len(cache) == 2
    for i in range(2):
        assert torch.equal(cache.get(f"w{i}", torch.float32).to(device), values[i])
    assert "refused" in cache.describe(4 << 20) and cache.slab_bytes == 2 << 20
    cache.close()
