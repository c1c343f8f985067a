"""engine/memory.py: weights moved into one huge-page arena keep their values, objects, layouts and aliasing."""

import pytest
import torch

from horizon.engine.memory import HUGE_PAGE, arena, huge_bytes, place_weights, unavailable

from .conftest import tiny_model

needs_thp = pytest.mark.skipif(unavailable() is not None, reason=f"no huge pages here: {unavailable()}")


class Holder(torch.nn.Module):
    """Tensors of the kinds a model holds: a linear layer, a weight tied to it, a transposed (non-contiguous)
    parameter, a view at an offset into another's storage, a uint8 buffer (packed MXFP4 blocks) and a bf16 one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(512, 1024)  # 2 MB of fp32 weight: the arena is over one huge page
        self.tied = torch.nn.Linear(512, 1024, bias=False)
        self.tied.weight = self.proj.weight
        self.t = torch.nn.Parameter(torch.randn(300, 200).t())
        base = torch.randn(4000)
        self.view = torch.nn.Parameter(base[1000:3000].view(40, 50))
        self.register_buffer("blocks", torch.randint(0, 256, (64, 33, 16), dtype=torch.uint8))
        self.register_buffer("low", torch.randn(7, 9).to(torch.bfloat16))


def snapshot(m: torch.nn.Module) -> dict:
    return {name: (t.detach().clone(), t.stride(), id(t))
            for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]}


@needs_thp
def test_weights_keep_values_objects_strides_and_aliasing():
    m = Holder()
    before = snapshot(m)
    placed = place_weights(m)
    assert placed.arena_bytes >= HUGE_PAGE and not placed.reason and placed.huge_bytes <= placed.arena_bytes
    after = snapshot(m)
    assert before.keys() == after.keys()
    for name, (value, stride, ident) in before.items():
        v, s, i = after[name]
        assert torch.equal(v, value) and v.dtype == value.dtype, name
        assert (s, i) == (stride, ident), name
    storages = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}
    assert len(storages) == 1  # one arena
    assert m.tied.weight is m.proj.weight
    with torch.no_grad():
        m.proj.weight[0, 0] = 123.0
    assert m.tied.weight[0, 0] == 123.0
    assert m.t.data_ptr() % 64 == 0 and m.blocks.data_ptr() % 64 == 0


@needs_thp
def test_placed_weights_train_and_forward_as_before():
    m = Holder()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # made before the move: it holds the same Parameter objects
    x = torch.randn(3, 512)
    ref = m.proj(x)
    place_weights(m)
    assert torch.equal(m.proj(x), ref)
    w0 = m.proj.weight.detach().clone()
    m.proj(x).sum().backward()
    opt.step()
    assert not torch.equal(m.proj.weight, w0)
    assert m.proj.weight.untyped_storage().data_ptr() == m.blocks.untyped_storage().data_ptr()  # stepped in place


@needs_thp
def test_a_model_gives_the_same_logits_and_state_dict_from_the_arena():
    model = tiny_model()
    tokens = torch.arange(1, 40)[None]
    with torch.no_grad():
        ref = model(tokens)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert place_weights(model).arena_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(tokens), ref)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@needs_thp
def test_placing_twice_leaves_the_arena_where_it_is():
    m = Holder()
    first = place_weights(m)
    ptr = m.proj.weight.data_ptr()
    second = place_weights(m)
    assert m.proj.weight.data_ptr() == ptr and second.arena_bytes == first.arena_bytes


def test_the_switch_and_small_models_leave_weights_in_place(monkeypatch):
    m = Holder()
    ptr = m.proj.weight.data_ptr()
    monkeypatch.setenv("HORIZON_HUGE_PAGES", "0")
    placed = place_weights(m)
    assert placed.arena_bytes == 0 and placed.reason == "HORIZON_HUGE_PAGES=0" and "left in place" in placed.describe()
    assert m.proj.weight.data_ptr() == ptr
    monkeypatch.delenv("HORIZON_HUGE_PAGES")
    small = torch.nn.Linear(16, 16)
    if unavailable() is None:
        assert "less than one 2 MB page" in place_weights(small).reason


@needs_thp
def test_the_arena_is_aligned_and_backed_by_huge_pages():
    a = arena(8 * HUGE_PAGE + 12_288)
    assert a.data_ptr() % HUGE_PAGE == 0 and a.numel() == 8 * HUGE_PAGE + 12_288 and not a.any()
    a.fill_(1)  # touched: now faulted in
    # the kernel may be short of free huge pages; it backs at least part of a fresh 16 MB region
    assert 0 < huge_bytes(a.untyped_storage()) <= 9 * HUGE_PAGE  # its last 12 KB fault in a ninth page
    # a second arena, never touched, has none: the two mappings are kept apart, not merged into one whose
    # pages smaps would report for both
    # (sizes off the 2 MB grid, as a model's are: the kernel does not space such mappings apart)
    b = arena(8 * HUGE_PAGE + 12_288)
    assert huge_bytes(b.untyped_storage()) == 0 and huge_bytes(a.untyped_storage()) > 0


def mappings() -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings, from /proc/self/maps, in address order."""
    with open("/proc/self/maps") as f:
        rows = [line.split()[:2] for line in f]
    return [(*(int(v, 16) for v in span.split("-")), perms) for span, perms in rows]


@needs_thp
def test_each_arena_is_fenced_by_inaccessible_pages_wherever_the_kernel_puts_it():
    # Without the fences the kernel may merge the arena with a neighbouring mapping of the same flags, and smaps
    # would count the neighbour's huge pages as its own (the test above sees that only when two arenas land
    # side by side). Here: the writable mapping under the arena has a 4 KB no-access page on each side.
    for size in (HUGE_PAGE + 12_288, 3 * HUGE_PAGE):
        a = arena(size)
        maps = mappings()
        (i,) = [k for k, (lo, hi, _) in enumerate(maps) if lo <= a.data_ptr() < hi]
        lo, hi, perms = maps[i]
        assert perms.startswith("rw") and hi >= a.data_ptr() + size, (size, maps[i])
        # (a fence may merge with the next arena's: no-access mappings of the same flags, side by side)
        assert maps[i - 1][1] == lo and maps[i - 1][2].startswith("---"), (maps[i - 1], maps[i])
        assert maps[i + 1][0] == hi and maps[i + 1][2].startswith("---"), (maps[i], maps[i + 1])
