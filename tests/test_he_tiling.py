"""Batch packing in tiles (:mod:`he.tiling`): segments of steps whose rows split into
independent components run a few components at a time, with the same results and less memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.backend import save_object
from he.runtime import run_batch
from he.tiling import (MAX_TILES, Segment, allocated_memory, batch_memory, choose_tiles,
                       find_segments, row_bytes_of, tile_masks)


class _Tokens(nn.Module):
    """Patch embedding, a Mu-Layer with spatial shift, one without, a mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(8, 2, 1, 8)
        self.shifted = pn.MuLayer(8, spatial_shift=True, norm="batch")
        self.mu = pn.MuLayer(8, hidden=16, norm="batch")
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        t = t + self.shifted(t)
        t = t + self.mu(t)
        return self.head(t.mean((1, 2)))


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    x = torch.rand(64, 1, 8, 8)
    model = _Tokens()
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x[:1], calibration=x, packing="batch")
    rb = row_bytes_of(prog.lowered, prog.params.poly_modulus_degree, prog.params.limbs)
    return model, x, prog, rb


def test_segments_split_rows_into_independent_components(compiled):
    _, _, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb)
    assert segments
    readers = {j: {si for si, st in enumerate(low.steps) if j in st.inputs}
               for j in range(len(low.steps))}
    for seg in segments:
        members = set(seg.steps)
        assert list(seg.steps) == list(range(min(members), max(members) + 1))
        # inner values are read only inside the segment; kept ones after it too
        assert all(readers[s] <= members for s in seg.inner)
        assert all(not readers[s] <= members or s == low.output for s in seg.keep)
        # no row of one component reads a row of another inside the segment
        for s in seg.steps:
            st = low.steps[s]
            for t, j in enumerate(st.inputs):
                if j not in members:
                    continue
                if st.kind == "affine":
                    coo = st.terms[t].tocoo()
                    ok = live[s][coo.row] & live[j][coo.col]
                    a, b = seg.labels[s][coo.row[ok]], seg.labels[j][coo.col[ok]]
                else:
                    rows = np.flatnonzero(live[s])
                    a, b = seg.labels[s][rows], seg.labels[j][rows]
                assert np.array_equal(a, b)
        masks = tile_masks(seg, 3)
        assert len(masks) == 3
        for s in seg.steps:       # every live row in exactly one tile
            hits = sum(m[s].astype(int) for m in masks)
            assert np.array_equal(hits, live[s].astype(int))


def test_tiles_give_bit_identical_results_and_less_memory(compiled):
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb)
    untiled = batch_memory(low, live, rb)
    tiles = {seg.end: min(seg.components, MAX_TILES) for seg in segments}
    assert batch_memory(low, live, rb, segments, tiles) < untiled
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x[:5].numpy())
    group = ct._seal_groups(server.engine.context)[0]
    full: list = [0.0] * int(np.prod(prog.input_shape))
    for k, c in zip(prog.batch_inputs, group):
        full[k] = c
    fanin = prog.options.get("fused_fanin")
    whole = run_batch(server.engine, low, live, full, fanin=fanin)
    tiled = run_batch(server.engine, low, live, full, fanin=fanin,
                      tiles=[(seg, 3) for seg in segments])
    assert len(whole) == len(tiled)
    for a, b in zip(whole, tiled):
        assert type(a) is type(b)
        assert (a == b) if isinstance(a, float) else save_object(a) == save_object(b)


def test_a_server_short_of_memory_runs_in_tiles_with_the_same_answer(compiled):
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb)
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    roomy = he.Server(prog, client.public_context())
    expected = client.decrypt(roomy.run(ct))
    assert roomy.tiles == {}
    # just above the most-tiled peak (plus the encoded weights' cache): tiles are needed
    from he.runtime import PLAIN_CACHE_BYTES
    budget = int(allocated_memory(low, live, rb, segments,
                                  {s.end: min(s.components, MAX_TILES) for s in segments},
                                  keep_inputs=False) + PLAIN_CACHE_BYTES) + 1
    tight = he.Server(prog, client.public_context(), memory_budget=budget)
    got = client.decrypt(tight.run(ct))
    assert tight.tiles and all(k > 1 for k in tight.tiles.values())
    assert np.array_equal(got, expected)


def test_choose_tiles_takes_none_when_the_group_fits_and_the_fewest_that_fit(compiled):
    _, _, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb)
    untiled = allocated_memory(low, live, rb)
    assert set(choose_tiles(low, live, rb, segments, untiled).values()) == {1}
    most = {s.end: min(s.components, MAX_TILES) for s in segments}
    floor = allocated_memory(low, live, rb, segments, most)
    assert floor < untiled
    chosen = choose_tiles(low, live, rb, segments, floor)
    assert allocated_memory(low, live, rb, segments, chosen) <= floor
    # under any budget below the floor, the most tiles
    assert choose_tiles(low, live, rb, segments, floor / 2) == most


def test_allocated_memory_follows_the_reuse_of_buffers_of_higher_levels():
    """A hand-built program: 4 inputs, a weighted map, a product, a weighted map to one output,
    rows of 40/30/20/10 bytes at levels 0-3. The server's buffers are reused smallest-first, so
    the product's rows land in the first map's freed input-level scratch (40 each) and the
    output in the freed buffers of the map's value: 620 bytes are allocated, where the values at
    their own sizes peak lower."""
    import scipy.sparse as sp
    from polynets.ir.lowering import Lowered, Step

    half = sp.csr_matrix(np.full((4, 4), 0.5))
    steps = [Step("input", (), (4,)),
             Step("affine", (0,), (4,), [half]),
             Step("mul", (1, 1), (4,)),
             Step("affine", (2,), (1,), [sp.csr_matrix(np.full((1, 4), 0.5))])]
    low = Lowered(steps, 3)
    live = [np.ones(4, bool), np.ones(4, bool), np.ones(4, bool), np.ones(1, bool)]
    size = {0: 40.0, 1: 30.0, 2: 20.0, 3: 10.0}

    def rb(s: int) -> float:                    # -s - 1: the step's inputs' level
        return size[s] if s >= 0 else size[max((0, *steps[-s - 1].inputs))]

    # inputs 160, the map's scratch 160 and value 120, the product's scratch 4 x 45 = 180;
    # the product's value reuses the scratch, the output the map's freed value
    assert allocated_memory(low, live, rb) == 620.0
    assert batch_memory(low, live, rb) < 620.0


def test_compile_reports_the_tiles_a_tight_budget_needs(compiled):
    model, x, prog, rb = compiled
    roomy = prog.plan.predicted
    assert roomy["tiles"] == {} and roomy["working_memory_bytes"] == \
        roomy["untiled_memory_bytes"]
    from he.compiler import _server_memory
    budget = int(_server_memory(prog.params, [], 0) + 0.9 * roomy["untiled_memory_bytes"])
    tight = he.compile(model, x[:1], calibration=x, packing="batch", memory_budget=budget)
    p = tight.plan.predicted
    assert p["tiles"] and p["working_memory_bytes"] < p["untiled_memory_bytes"]
    assert "run in tiles" in tight.plan.why
    # the time is priced the same: tiles change the memory only
    assert p["seconds_per_ciphertext"] == pytest.approx(roomy["seconds_per_ciphertext"])


def test_a_segment_needs_two_components():
    seg = Segment(keep=(2,), inner=(1,), labels={1: np.array([0, 0]), 2: np.array([0, -1])},
                  components=1)
    masks = tile_masks(seg, 4)
    assert len(masks) == 1 and masks[0][1].all()


def test_inputs_handed_over_are_freed_after_their_readers_with_the_same_results(compiled):
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x[:3].numpy())

    def group() -> list:
        full: list = [0.0] * int(np.prod(prog.input_shape))
        for k, c in zip(prog.batch_inputs, ct._seal_groups(server.engine.context)[0]):
            full[k] = c
        return full

    fanin = prog.options.get("fused_fanin")
    kept_inputs = group()
    whole = run_batch(server.engine, low, live, kept_inputs, fanin=fanin)
    handed = group()
    freed = run_batch(server.engine, low, live, handed, fanin=fanin, own_inputs=True)
    assert any(not isinstance(e, float) for e in kept_inputs)      # the caller's, untouched
    assert all(isinstance(e, float) for e in handed)               # dropped once read
    for a, b in zip(whole, freed):
        assert (a == b) if isinstance(a, float) else save_object(a) == save_object(b)
    # the memory rule counts them only until their last reader
    assert batch_memory(low, live, rb, keep_inputs=False) <= batch_memory(low, live, rb)
