"""Batch packing in tiles (:mod:`he.tiling`): segments of steps run as a wavefront of tiles,
every row computed once before its readers and freed after the last, with the same results and
less memory."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as hst
from torch import nn

import he
import polynets as pn
from he.backend import save_object
from he.runtime import eager_products, run_batch
from he.tiling import (MAX_TILES, Segment, _Reads, _segment, _sweep, allocated_memory,
                       batch_memory, buffer_bytes, choose_tiles, find_segments, row_bytes_of,
                       tile_plan)


@contextlib.contextmanager
def _new_storage() -> Iterator[collections.Counter]:
    """Counts the new ciphertext storage a server's group takes (bytes of one -> how many): a
    result no free ciphertext holds, an input loaded in a tile that no free ciphertext holds,
    and once the staging buffer of those copied into free ones (SEAL's pool serves it again)."""
    import he.runtime as runtime
    new: collections.Counter = collections.Counter()
    take, adopt = runtime._Buffers._take, runtime._Buffers.adopt
    staged: list[bool] = []

    def counted(self, eng, parms_id, limbs, size):
        need = size * eng.params.poly_modulus_degree * limbs
        if not any(c >= need and pool for c, pool in self.free.items()):
            new[8 * need] += 1
        return take(self, eng, parms_id, limbs, size)

    def adopted(self, eng, c):
        need = c.size() * eng.params.poly_modulus_degree * c.coeff_modulus_size()
        if any(cap >= need and pool for cap, pool in self.free.items()):
            if not staged:
                staged.append(True)
                new[8 * need] += 1
            return adopt(self, eng, c)
        new[8 * need] += 1
        return c

    runtime._Buffers._take, runtime._Buffers.adopt = counted, adopted
    try:
        yield new
    finally:
        runtime._Buffers._take, runtime._Buffers.adopt = take, adopt


def _most_tiles(low, live, rb) -> tuple[list[Segment], dict[int, int], int]:
    """The program's segments (inputs owned by the server), each in the most tiles, and the
    memory budget just above what a group allocates with them (the encoded weights' cache
    included): a server given it runs in tiles."""
    from he.runtime import PLAIN_CACHE_BYTES
    segments = find_segments(low, live, rb, keep_inputs=False)
    most = {s.end: min(s.components, MAX_TILES) for s in segments}
    budget = int(allocated_memory(low, live, rb, segments, most, keep_inputs=False)
                 + PLAIN_CACHE_BYTES) + 1
    return segments, most, budget


def _check_loads(low, seg: Segment, tiles: int) -> None:
    """Every live input row is loaded in one tile, never after a tile that reads it."""
    from he.tiling import _tile_indices
    _, tile_of, _, load_at = _tile_indices(seg, tiles)
    assert np.array_equal(load_at >= 0, seg.load >= 0)
    for s in seg.steps:
        st = low.steps[s]
        if 0 not in st.inputs or s not in tile_of:
            continue
        m = st.terms[st.inputs.index(0)].tocsr() if st.kind == "affine" else None
        for i in range(int(tile_of[s].max()) + 1):
            rows = np.flatnonzero(tile_of[s] == i)
            read = np.unique(m[rows].indices) if m is not None else rows
            assert (load_at[read] <= i).all()


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
    prog = he.compile(model, x[:1], calibration=x, packing="batch",
                    final_map="server")
    rb = row_bytes_of(prog.lowered, prog.params.poly_modulus_degree, prog.params.limbs)
    return model, x, prog, rb


def _check_plan(low, live, seg: Segment, tiles: int) -> None:
    """Every live row of the segment's steps is computed in exactly one tile, after the rows it
    reads (an earlier tile, or an earlier step of the same one), which are not freed before;
    inner rows are freed exactly once, kept ones never."""
    plan = tile_plan(seg, tiles)
    assert len(plan) == min(tiles, seg.components)
    steps = low.steps
    ranked = [s for s in seg.steps if not (seg.reduce and s == seg.end)]
    when = {s: np.full(steps[s].n, -1) for s in ranked}
    gone = {s: np.full(steps[s].n, -1) for s in seg.last}
    for i, tile in enumerate(plan):
        for s in ranked:
            assert not (tile.compute[s] & (when[s] >= 0)).any()
            when[s][tile.compute[s]] = i
        for s, rows in tile.free.items():
            assert not (rows & (gone[s] >= 0)).any()
            gone[s][rows] = i
    for s in ranked:
        assert np.array_equal(when[s] >= 0, live[s])
    for s in seg.inner:
        assert np.array_equal(gone[s] >= 0, live[s])
        assert (gone[s][live[s]] >= when[s][live[s]]).all()
    assert not any(s in seg.last for s in seg.keep)
    for s in ranked:
        st = steps[s]
        for t, j in enumerate(st.inputs):
            if j not in when:
                continue
            if st.kind == "affine":
                coo = st.terms[t].tocoo()
                ok = live[s][coo.row] & live[j][coo.col]
                reader, read = coo.row[ok], coo.col[ok]
            else:
                reader = read = np.flatnonzero(live[s])
            assert (when[j][read] <= when[s][reader]).all()
            if j in gone:
                assert (gone[j][read] >= when[s][reader]).all()


def test_tiles_compute_every_row_once_before_its_readers_and_free_it_after(compiled):
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
        for tiles in (2, 3, MAX_TILES):
            _check_plan(low, live, seg, tiles)
    # every run of steps, ending in a reduction or not, plans correctly
    reads = _Reads(low, live)
    for end in range(2, len(low.steps)):
        for reduce in (False, True):
            if reduce and low.steps[end].kind != "affine":
                continue
            swept = _sweep(low, live, reads, end, reduce)
            for start in range(1, end):
                seg = _segment(low, reads, swept, start, end, reduce, True)
                if seg is not None and seg.components > 1:
                    _check_plan(low, live, seg, 4)


def test_a_shifted_token_model_runs_as_a_wavefront_in_a_fraction_of_its_memory():
    """A spatial shift joins every token to its neighbours: no token is independent, yet a
    wavefront of tiles holds a band of them; the head over every token is summed tile by
    tile."""
    torch.manual_seed(0)
    model = pn.MONet(img_size=16, in_chans=1, num_classes=3, patch_size=2, embed_dim=8,
                     depth=2, merges=1, norm="batch").eval()
    x = torch.rand(8, 1, 16, 16)
    prog = he.compile(model, x[:1], calibration=x, packing="batch",
                    final_map="server")
    low, live = prog.lowered, prog.plan.live
    rb = row_bytes_of(low, prog.params.poly_modulus_degree, prog.params.limbs)
    segments = find_segments(low, live, rb, keep_inputs=False)
    assert segments and segments[-1].reduce and segments[-1].end == low.output
    most = {s.end: MAX_TILES for s in segments}
    untiled = allocated_memory(low, live, rb, keep_inputs=False)
    assert allocated_memory(low, live, rb, segments, most, keep_inputs=False) < 0.6 * untiled
    for seg in segments:
        _check_plan(low, live, seg, MAX_TILES)


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
    # the same runs of steps, none ending in a reduction: every word the same
    reads = _Reads(low, live)
    plain = [_segment(low, reads, _sweep(low, live, reads, seg.end, False), min(seg.steps),
                      seg.end, False, False) for seg in segments]
    for tiles in (3, MAX_TILES):
        tiled = run_batch(server.engine, low, live, full, fanin=fanin,
                          tiles=[(seg, tiles) for seg in plain if seg is not None])
        assert len(whole) == len(tiled)
        for a, b in zip(whole, tiled):
            assert type(a) is type(b)
            assert (a == b) if isinstance(a, float) else save_object(a) == save_object(b)
    # as found (a head over every token summed tile by tile): the same modular sums, with the
    # constants added after the rescale, so the same values to far within the promised error
    assert any(seg.reduce for seg in segments)
    summed = run_batch(server.engine, low, live, full, fanin=fanin,
                       tiles=[(seg, 3) for seg in segments])
    a, b = _decrypted(client, whole, 5), _decrypted(client, summed, 5)
    assert np.abs(a - b).max() <= 0.05 * prog.params.expected_error


def _decrypted(client, outs: list, n: int) -> np.ndarray:
    """The first ``n`` slots of every output element (a float: itself)."""
    import tenseal.sealapi as seal
    rows = []
    for c in outs:
        if isinstance(c, float):
            rows.append(np.full(n, c))
            continue
        pt = seal.Plaintext()
        client._decryptor.decrypt(c, pt)
        rows.append(np.asarray(client.engine.encoder.decode_double(pt))[:n])
    return np.array(rows)


def test_a_server_short_of_memory_runs_in_tiles_with_the_same_answer(compiled, monkeypatch):
    """In tiles, a reduction reading lazy products sums its tiles' parts over them and
    finishes (relinearises, rescales) each of its rows once, as a group run whole does; with
    every product finished (:func:`he.runtime.eager_products`) the tiles answer as one pass."""
    import he.runtime as runtime
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb)
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    roomy = he.Server(prog, client.public_context())
    with eager_products():
        expected = client.decrypt(roomy.run(ct))
    assert roomy.tiles == {}
    lazy = client.decrypt(roomy.run(ct))
    assert roomy.lazy_products == tuple(prog.options["lazy_products"]) != ()
    assert np.abs(lazy - prog.simulate(x[:5].numpy())).max() <= prog.params.expected_error
    # just above the most-tiled peak with the lazy products (plus the encoded weights'
    # cache): tiles are needed
    from he.runtime import PLAIN_CACHE_BYTES
    rb_lazy = row_bytes_of(low, prog.params.poly_modulus_degree, prog.params.limbs,
                           prog.options["lazy_products"])
    budget = int(allocated_memory(low, live, rb_lazy, segments,
                                  {s.end: min(s.components, MAX_TILES) for s in segments},
                                  keep_inputs=False) + PLAIN_CACHE_BYTES) + 1
    assert budget < allocated_memory(low, live, rb, keep_inputs=False)
    tight = he.Server(prog, client.public_context(), memory_budget=budget)
    finished: list[int] = []
    real = runtime._finish_lazy

    def counted(eng, sums, level, buffers):
        finished.extend(sums)
        return real(eng, sums, level, buffers)

    monkeypatch.setattr(runtime, "_finish_lazy", counted)
    got = client.decrypt(tight.run(ct))
    assert tight.tiles and all(k > 1 for k in tight.tiles.values())
    assert tight.lazy_products == roomy.lazy_products
    readers = [s for s, st in enumerate(low.steps) if set(st.inputs) & set(tight.lazy_products)]
    assert any(seg.reduce and seg.end in readers and seg.end in tight.tiles
               for seg in tight._segments)
    # each row of the maps reading the lazy products finished once, not once per tile
    assert sorted(finished) == sorted(r for s in readers for r in np.flatnonzero(live[s]))
    # a reduction adds its constants after the rescale: the same values within noise
    assert np.abs(got - lazy).max() <= 0.05 * prog.params.expected_error
    with eager_products():
        got = client.decrypt(tight.run(ct))
    assert np.abs(got - expected).max() <= 0.05 * prog.params.expected_error


def test_a_tiled_server_loads_each_input_in_the_tile_that_first_reads_it(compiled, monkeypatch):
    """Where a segment reads every input, a server that owns them (loaded from bytes) loads
    each in the first tile reading it, once; the group then holds less than with every input
    loaded first. Every part is validated before anything runs: a corrupted part of a later
    tile is refused up front, not met halfway."""
    import he.client as client_mod
    from he.runtime import PLAIN_CACHE_BYTES
    from he.tiling import _tile_indices
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb, keep_inputs=False)
    seg = next(s for s in segments if s.load is not None)
    k = min(seg.components, MAX_TILES)
    assert np.array_equal(seg.load >= 0, live[0])
    _check_loads(low, seg, k)
    _, _, _, load_at = _tile_indices(seg, k)
    tiles = {seg.end: k}
    owned = allocated_memory(low, live, rb, segments, tiles, keep_inputs=False)
    kept = allocated_memory(low, live, rb, segments, tiles, keep_inputs=True)
    assert owned < kept
    client = he.Client(prog)
    ct = client.encrypt(x[:3].numpy())
    budget = int(owned + PLAIN_CACHE_BYTES) + 1
    tight = he.Server(prog, client.public_context(), memory_budget=budget)
    bad = he.Ciphertext.from_bytes(ct.to_bytes())
    last = int(np.argmax(np.where(live[0], load_at, -1)))      # loaded in the last tile
    part = int(np.searchsorted(prog.batch_inputs, last))
    blob = bad._groups[0][part]
    bad._groups[0][part] = blob[:len(blob) // 2]
    ran = []
    real = client_mod.run_batch
    monkeypatch.setattr(client_mod, "run_batch", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    with pytest.raises(he.SerializationError, match=f"ciphertext part 0.{part}"):
        tight.run(bad.to_bytes())
    assert not ran
    out = tight.run(ct.to_bytes()).to_bytes()
    got = client.decrypt(out)
    assert tight.tiles == tiles and ran
    assert np.abs(got - prog.simulate(x[:3].numpy())).max() <= prog.params.expected_error
    # the inputs loaded through SEAL's own stream instead of straight into their buffers (on
    # the server's threads): the same answer, byte for byte
    from he import wire
    with wire.seal_loads():
        assert tight.run(ct.to_bytes()).to_bytes() == out


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
    budget = int(_server_memory(prog.params, [], 0) + 0.6 * roomy["untiled_memory_bytes"])
    tight = he.compile(model, x[:1], calibration=x, packing="batch", memory_budget=budget,
                    final_map="server")
    p = tight.plan.predicted
    assert p["tiles"] and p["working_memory_bytes"] < p["untiled_memory_bytes"]
    assert "run in tiles" in tight.plan.why
    # the products left lazy whole stay lazy in these tiles (they fit without spilling)
    assert p["lazy_products"] == prog.options["lazy_products"] != []
    # the time is priced as one pass with the same lazy products, and each input checked
    # first where tiles load them (then loaded where first read, once, as whole): tiles change
    # the memory
    from he.compiler import _predict_batch
    costs = he.costmodel.default_model()
    whole = _predict_batch(prog.lowered, prog.plan.live, prog.params, costs,
                           prog.options["fused_fanin"], prog.server_threads,
                           lazy=prog.options["lazy_products"])
    n_in = int(prog.plan.live[0].sum())
    assert whole["counts"]["load"] == p["counts"]["load"] == n_in
    assert whole["counts"]["check"] == 0 and p["counts"]["check"] == n_in
    ring, threads = prog.params.poly_modulus_degree, prog.server_threads
    speedup = threads * costs.batch_efficiency(ring) if threads > 1 else 1.0
    again = n_in * costs.seconds("check", ring, prog.params.limbs(0)) / speedup
    assert p["seconds_per_ciphertext"] == pytest.approx(whole["seconds_per_ciphertext"] + again)


def test_lazy_products_run_in_tiles_where_the_cost_model_prices_them_below_a_whole_group(
        compiled):
    """Under a budget that holds the group whole only with every product finished, the
    compiler prices the lazy products in tiles against finished ones whole and keeps the
    cheaper (``lazy_in_tiles``); a server under that budget does what the compiler chose, and
    answers within the promised error. A program file whose choice is not a bool is refused."""
    model, x, prog, rb = compiled
    from he.compiler import CompiledProgram, _predict_batch, _server_memory
    from he.runtime import PLAIN_CACHE_BYTES
    low, live, params = prog.lowered, prog.plan.live, prog.params
    lazy = prog.options["lazy_products"]
    eager = allocated_memory(low, live, rb, keep_inputs=False)
    lazy_whole = allocated_memory(low, live, row_bytes_of(
        low, params.poly_modulus_degree, params.limbs, lazy), keep_inputs=False)
    keys = _server_memory(params, [], 0)
    budget = int(keys + PLAIN_CACHE_BYTES + (eager + lazy_whole) / 2)
    tight = he.compile(model, x[:1], calibration=x, packing="batch", memory_budget=budget,
                    final_map="server")
    costs = he.costmodel.default_model()
    room = budget - keys
    whole, in_tiles = (_predict_batch(low, live, params, costs, tight.options["fused_fanin"],
                                      budget=room, lazy=lazy, lazy_in_tiles=first)
                       for first in (False, True))
    assert whole["tiles"] == {} and whole["lazy_products"] == []
    assert in_tiles["tiles"] and in_tiles["lazy_products"] == lazy
    cheaper = in_tiles["seconds_per_ciphertext"] < whole["seconds_per_ciphertext"]
    assert tight.options.get("lazy_in_tiles", False) == cheaper
    assert cheaper, "this model's head makes the lazy products pay for the tiles"
    p = tight.plan.predicted
    assert p["tiles"] == in_tiles["tiles"] and p["lazy_products"] == lazy
    assert "in tiles with them" in tight.plan.why
    client = he.Client(tight)
    server = he.Server(tight, client.public_context())
    xs = x[:4].numpy()
    got = client.decrypt(server.run(client.encrypt(xs).to_bytes()))
    assert server.lazy_products == tuple(lazy)
    assert {str(e): k for e, k in server.tiles.items()} == p["tiles"]
    assert np.abs(got - tight.simulate(xs)).max() <= tight.params.expected_error
    # without the choice, the same budget runs the group whole with every product finished
    unchosen = CompiledProgram(tight.program, tight.params, "batch", tight.calibration,
                               {**tight.options, "lazy_in_tiles": False}, tight.certificate)
    other = he.Client(unchosen)
    plain = he.Server(unchosen, other.public_context(), memory_budget=tight.server_room())
    plain.run(other.encrypt(xs).to_bytes())
    assert plain.lazy_products == () and plain.tiles == {}
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="lazy_in_tiles"):
            CompiledProgram(tight.program, tight.params, "batch", tight.calibration,
                            {**tight.options, "lazy_in_tiles": bad}, tight.certificate)


def test_a_server_plans_its_tiles_for_the_budget_the_program_was_compiled_for(compiled):
    """A server given no budget of its own takes what the compile-time budget leaves beside the
    keys (``server_room``), so it runs the tiles the compiler predicted, not a group sized for
    all the memory of the machine it runs on; its own budget still wins where given."""
    model, x, prog, _ = compiled
    from he.compiler import _server_memory
    roomy = prog.plan.predicted
    assert prog.memory_budget is None and prog.server_room() is None
    keys = _server_memory(prog.params, [], 0)
    budget = int(keys + 0.6 * roomy["untiled_memory_bytes"])
    tight = he.compile(model, x[:1], calibration=x, packing="batch", memory_budget=budget,
                    final_map="server")
    assert tight.memory_budget == budget and tight.server_room() == budget - keys
    assert tight.key_bytes() == keys
    predicted = {int(e): k for e, k in tight.plan.predicted["tiles"].items()}
    assert predicted
    # the budget travels with the program's bytes, checked on the way in
    again = he.compiler.CompiledProgram.from_bytes(tight.to_bytes())
    assert again.memory_budget == budget
    client = he.Client(again)
    server = he.Server(again, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:4])))
    assert server.tiles == predicted
    assert np.abs(got - tight.simulate(x[:4].numpy())).max() <= tight.params.expected_error
    own = he.Server(again, client.public_context(), memory_budget=2 ** 40)
    own.run(client.encrypt(x[:4]))
    assert own.tiles == {}


def test_a_stored_memory_budget_must_be_a_non_negative_int(compiled):
    _, _, prog, _ = compiled
    for bad in (-1, 2.5, "1"):
        with pytest.raises(ValueError, match="memory_budget must be a non-negative int"):
            he.compiler.CompiledProgram(prog.program, prog.params, prog.packing,
                                        prog.calibration, {**prog.options,
                                                           "memory_budget": bad})


def test_a_segment_of_one_sink_runs_in_one_tile():
    seg = Segment(keep=(2,), inner=(1,), rank={1: np.array([5, 5]), 2: np.array([5, -1])},
                  last={1: np.array([5, 5])}, sinks=np.array([5]))
    plan = tile_plan(seg, 4)
    assert len(plan) == 1 and plan[0].compute[1].all() and plan[0].free[1].all()


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


def test_candidates_over_the_memory_budget_rank_by_the_memory_they_need():
    """Programs whose server fits the budget rank by predicted time; where none fits, the one
    needing least memory comes first (a server refuses a group it cannot hold)."""
    from types import SimpleNamespace

    from he.compiler import _rank

    def prog(seconds: float, memory: float) -> SimpleNamespace:
        return SimpleNamespace(options={}, plan=SimpleNamespace(predicted={
            "round_trip_seconds": seconds, "server_memory_bytes": memory,
            "samples_per_ciphertext": 1}))

    fast_big, slow_small = prog(1.0, 30e9), prog(2.0, 9e9)
    over = sorted([fast_big, slow_small], key=lambda p: _rank(p, "latency", None, int(4e9)))
    assert over[0] is slow_small
    fits = sorted([fast_big, slow_small], key=lambda p: _rank(p, "latency", None, int(40e9)))
    assert fits[0] is fast_big
    one = sorted([fast_big, slow_small], key=lambda p: _rank(p, "latency", None, int(10e9)))
    assert one[0] is slow_small
    assert _rank(fast_big, "latency", None, int(40e9))[-1] == 1.0      # the cost comes last


def test_the_simulated_buffers_are_those_a_group_allocates(compiled, monkeypatch):
    """:func:`he.tiling.allocations` follows the runtime's reuse of buffers size by size, whole
    and in tiles: the new ciphertext storage a group takes (its inputs loaded from bytes among
    it, counted as the evaluation adopts them), from no free ciphertext, exceeds the simulated
    count of its size by a few rows' worth at most."""
    import he.runtime as runtime
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    _, _, tight = _most_tiles(low, live, rb)
    for budget in (None, tight):
        # from no free ciphertext (a cold server in a fresh process)
        monkeypatch.setattr(runtime, "_SPARE", {})
        server = he.Server(prog, client.public_context(), memory_budget=budget, warm=False)
        mem = server._group_memory(server._free_memory(), keep=False)
        with _new_storage() as new:
            server.run(ct)
        assert (server.tiles != {}) == (budget is not None)
        made = dict(new)
        loads = any(seg.load is not None and server.tiles.get(seg.end, 1) > 1
                    for seg in server._segments or ())
        assert loads == (budget is not None)     # this program's segment reads every input
        # inputs are loaded by the evaluation (adopted into free buffers) whole or in tiles
        total = sum(b * k for b, k in made.items())
        short = sum(b * max(0, k - mem.buffers.get(b, 0)) for b, k in made.items())
        assert short <= 0.1 * total


def test_a_warm_batch_server_answers_as_a_cold_one_and_a_vector_one_runs_a_request(
        compiled, monkeypatch):
    """A warm server holds the free ciphertexts its group's simulation allocates (those this
    process held already among them); its first request writes into them and takes little
    new storage, in tiles or whole, and answers as a cold server does."""
    import he.runtime as runtime
    from he.runtime import spare_buffers
    _, x, prog, rb = compiled
    low, live = prog.lowered, prog.plan.live
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    monkeypatch.setattr(runtime, "_SPARE", {})
    cold = he.Server(prog, client.public_context(), warm=False)
    assert cold.warm_bytes == 0 and spare_buffers(cold._pool_key) == {}
    expected = client.decrypt(cold.run(ct))
    _, _, tight = _most_tiles(low, live, rb)
    for budget in (None, tight):
        monkeypatch.setattr(runtime, "_SPARE", {})
        warm = he.Server(prog, client.public_context(), memory_budget=budget)
        mem = warm._group_memory(warm._free_memory(), keep=False)
        assert warm.warm_bytes == sum(int(b) * k for b, k in mem.buffers.items()) > 0
        assert warm.warm_seconds > 0 and spare_buffers(warm._pool_key) == mem.buffers
        # in NTT form, which the fused maps' results, written word by word, need: the first
        # request copies nothing into them to give them that form
        assert all(c.is_ntt_form() for c in runtime._SPARE[(os.getpid(), warm._pool_key)])
        again = he.Server(prog, client.public_context(), memory_budget=budget)
        assert spare_buffers(warm._pool_key) == mem.buffers       # nothing more allocated
        with _new_storage() as new:
            got = client.decrypt(warm.run(ct))
        assert (warm.tiles != {}) == (budget is not None)
        assert sum(b * k for b, k in new.items()) <= 0.1 * warm.warm_bytes
        if budget is None:
            assert np.array_equal(got, expected)
        else:               # every product finished in tiles: the same values within noise
            assert np.abs(got - prog.simulate(x[:5].numpy())).max() <= \
                prog.params.expected_error
        # the group's free ciphertexts are left for the next
        assert buffer_bytes(spare_buffers(warm._pool_key)) >= 0.9 * warm.warm_bytes
        assert again.warm_bytes == warm.warm_bytes
    # vector packing allocates nothing ahead: it runs an encryption of zero through the program
    model = nn.Sequential(nn.Linear(4, 3))
    vec = he.compile(model, torch.rand(8, 4), packing="vector")
    ctx = he.Client(vec).public_context()
    server = he.Server(vec, ctx)
    assert server.warm_bytes == 0 and server.warm_seconds > 0
    cold = he.Server(vec, ctx, warm=False)
    assert cold.warm_seconds == 0 and cold.warm() > 0 and cold.warm_bytes == 0


@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_batch_servers_free_buffers_do_not_grow_with_its_requests(compiled, monkeypatch,
                                                                     tiled):
    """A request's inputs are loaded into the group's free buffers, whole or in tiles: a serving
    process holds no more after two requests than after one (each request's inputs in new
    storage, left free at its end, grew it by the inputs every request)."""
    import he.runtime as runtime
    from he.runtime import spare_buffers
    _, x, prog, rb = compiled
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    budget = _most_tiles(prog.lowered, prog.plan.live, rb)[2] if tiled else None
    monkeypatch.setattr(runtime, "_SPARE", {})
    server = he.Server(prog, client.public_context(), memory_budget=budget)
    first = client.decrypt(server.run(ct))
    assert (server.tiles != {}) == tiled
    held = buffer_bytes(spare_buffers(server._pool_key))
    assert np.array_equal(client.decrypt(server.run(ct)), first)
    assert buffer_bytes(spare_buffers(server._pool_key)) <= held


def test_forked_workers_do_not_count_on_this_process_pool(compiled, monkeypatch):
    """The memory a warm server's pool holds serves this process's groups, not those of forked
    workers (their writes to it are copies, and it stays resident here): two processes asked
    for where only the pool would make room for the second are refused before anything runs."""
    import he.client
    from he.runtime import pool_held
    _, x, prog, _ = compiled
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    assert pool_held(server._pool_key) >= server.warm_bytes > 0
    working = server._group_memory(server._free_memory(), keep=False).working
    ct = client.encrypt(np.repeat(x[:1].numpy(), prog.params.slots + 1, axis=0))  # two groups
    assert len(ct._groups) == 2
    # with the pool, room for two groups; without it, for one
    monkeypatch.setattr(he.client, "available_memory", lambda: int(1.5 * working))
    assert server._free_memory() >= 2 * working
    with pytest.raises(he.ResourceError, match="at most 1 fit"):
        server.run(ct, workers=2)


class _RandomTokens(nn.Module):
    """A patch embedding, Mu-Layers (some with the spatial shift) and a head over every token
    (flattened) or their mean: the shapes of the token models users bring."""

    def __init__(self, patch: int, dim: int, shifts: tuple[bool, ...], pool: bool):
        super().__init__()
        self.embed = pn.PatchEmbed(8, patch, 1, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, spatial_shift=s, norm="batch") for s in shifts)
        self.pool = pool
        self.head = nn.Linear(dim if pool else dim * (8 // patch) ** 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.mean((1, 2)) if self.pool else t.flatten(1))


def _random_tokens_compiled(seed: int, patch: int, dim: int, shifts: tuple[bool, ...],
                            pool: bool, n: int) -> tuple[torch.Tensor, he.CompiledProgram, Any]:
    """A :class:`_RandomTokens` model (its BatchNorm statistics from ``n`` random images),
    compiled to batch packing: the images, the program and its bytes per row."""
    torch.manual_seed(seed)
    model = _RandomTokens(patch, dim, shifts, pool)
    x = torch.rand(n, 1, 8, 8)
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x[:1], calibration=x, packing="batch",
                    final_map="server")
    return x, prog, row_bytes_of(prog.lowered, prog.params.poly_modulus_degree,
                                 prog.params.limbs)


@pytest.mark.slow
@settings(max_examples=4, deadline=None,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))   # examples of a minute each
@given(seed=hst.integers(0, 10 ** 6), patch=hst.sampled_from([1, 2]), dim=hst.sampled_from([4, 8]),
       shifts=hst.sampled_from([(True,), (False,), (True, False), (False, True)]),
       pool=hst.booleans())
def test_random_token_models_in_tiles_load_their_inputs_where_read_and_answer_as_whole(
        seed, patch, dim, shifts, pool):
    """On random token models, a server given just the memory its group allocates in the most
    tiles runs in tiles, loads each input it owns in the first tile reading it (never after),
    answers as a server holding the whole group (within noise) and the simulation (within the
    promise). From no free ciphertext it allocates what the simulation says (within a tenth of
    the bytes); warm, its first request writes into the ciphertexts it allocated as it started
    (a fifth of their bytes new at most: a few buffers on these small groups)."""
    import he.runtime as runtime
    x, prog, rb = _random_tokens_compiled(seed, patch, dim, shifts, pool, 64)
    low, live = prog.lowered, prog.plan.live
    segments, most, budget = _most_tiles(low, live, rb)
    if not segments:
        return                                  # nothing this program could run in tiles
    for seg in segments:
        _check_plan(low, live, seg, most[seg.end])
        if seg.load is not None:
            assert np.array_equal(seg.load >= 0, live[0])
            _check_loads(low, seg, most[seg.end])
    client = he.Client(prog)
    ct = client.encrypt(x[:4].numpy()).to_bytes()
    with eager_products():
        whole = client.decrypt(he.Server(prog, client.public_context()).run(ct))
    for warm in (False, True):
        runtime._SPARE.clear()      # as in a fresh process
        tight = he.Server(prog, client.public_context(), memory_budget=budget, warm=warm)
        mem = tight._group_memory(tight._free_memory(), keep=False)
        with _new_storage() as new:
            got = client.decrypt(tight.run(ct))
        assert tight.tiles
        assert np.abs(got - whole).max() <= 0.05 * prog.params.expected_error
        assert np.abs(got - prog.simulate(x[:4].numpy())).max() <= prog.params.expected_error
        taken = sum(b * k for b, k in new.items())
        if warm:            # written into the ciphertexts allocated at the start
            assert taken <= 0.2 * tight.warm_bytes
        else:               # what the simulation says, within a tenth
            assert taken <= 1.1 * buffer_bytes(mem.buffers)


@pytest.fixture(scope="module")
def shifted_monet():
    """A MONet whose spatial shifts make its tiles hold rows for later tiles (a band)."""
    torch.manual_seed(0)
    model = pn.MONet(img_size=12, in_chans=1, num_classes=3, patch_size=2, embed_dim=8,
                     depth=2, merges=1, norm="batch").eval()
    x = torch.rand(8, 1, 12, 12)
    prog = he.compile(model, x[:1], calibration=x, packing="batch",
                    final_map="server")
    rb = row_bytes_of(prog.lowered, prog.params.poly_modulus_degree, prog.params.limbs)
    return model, x, prog, rb


def test_spilling_tiles_write_out_what_later_tiles_read_with_the_same_words(shifted_monet):
    """Rows a tile holds for a later one go to disk and come back where next read: the same
    ciphertexts word for word, each row out and back once per gap, and the memory rules (peak
    and allocation) hold less."""
    from he.tiling import spills
    _, x, prog, rb = shifted_monet
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb, keep_inputs=False)
    most = {s.end: min(s.components, 8) for s in segments}
    events = sum(v[0].size for seg in segments for v in spills(low, seg, most[seg.end]).values())
    assert events > 0
    for seg in segments:
        for s, (rows, out_at, back_at) in spills(low, seg, most[seg.end]).items():
            assert s in seg.inner and (back_at > out_at + 1).all()
    assert batch_memory(low, live, rb, segments, most, False, True) < \
        batch_memory(low, live, rb, segments, most, False)
    # what a group allocates falls too with the most tiles, where the compiler spills (no
    # number of tiles fits); with fewer, reused buffers can fit the rows read back worse (at 8
    # tiles here: 0.6% more), and the compiler compares the two allocations before it spills
    widest = {s.end: min(s.components, MAX_TILES) for s in segments}
    assert allocated_memory(low, live, rb, segments, widest, False, True) < \
        allocated_memory(low, live, rb, segments, widest, False)
    _spills_to_the_same_words(prog, x[:4], [(seg, most[seg.end]) for seg in segments], events)


def _spills_to_the_same_words(prog: he.CompiledProgram, x: torch.Tensor,
                              plan: list[tuple[Segment, int]], events: int) -> None:
    """One group of ``x`` run in the tiles of ``plan`` in memory, then spilling: the same
    ciphertexts word for word, each of the ``events`` planned spills written and read once."""
    from he.runtime import SpillFile
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    group = client.encrypt(x.numpy())._seal_groups(server.engine.context)[0]
    full: list = [0.0] * int(np.prod(prog.input_shape))
    for k, c in zip(prog.batch_inputs, group):
        full[k] = c
    run = functools.partial(run_batch, server.engine, prog.lowered, prog.plan.live,
                            fanin=prog.options.get("fused_fanin"), tiles=plan)
    kept = run(list(full))
    spill = SpillFile()
    spilled = run(list(full), spill=spill)
    assert spill.written == spill.read_back == events
    spill.close()
    for a, b in zip(kept, spilled):
        assert (a == b) if isinstance(a, float) else save_object(a) == save_object(b)


def test_a_row_spilled_to_a_corrupted_or_truncated_file_is_an_error(shifted_monet):
    import os
    from he.runtime import SpillFile
    _, x, prog, _ = shifted_monet
    client = he.Client(prog)
    eng = client.engine
    ct = client.encrypt(x[:2].numpy())._seal_groups(eng.context)[0][0]
    spill = SpillFile()
    assert spill.write("a", ct) and spill.write("b", ct) and not spill.write("a", ct)
    back = spill.read("a", eng.new_ciphertext(), eng.context)
    assert save_object(back) == save_object(ct)
    fd = spill._file.fileno()
    at = spill._rows["b"][0]
    os.pwrite(fd, b"\x01\x02\x03", at + 100)
    with pytest.raises(he.SerializationError, match="corrupted"):
        spill.read("b", eng.new_ciphertext(), eng.context)
    assert spill.write("c", ct)
    os.ftruncate(fd, spill._rows["c"][0] + 10)
    with pytest.raises(he.SerializationError, match="short"):
        spill.read("c", eng.new_ciphertext(), eng.context)
    spill.close()


@pytest.mark.slow
def test_a_server_whose_tiles_do_not_fit_spills_and_answers_the_same(shifted_monet):
    """Below what the most tiles allocate, a server spills (the compiler's rule, priced in its
    prediction) and answers as a roomy one does, within noise (a head summed tile by tile)."""
    from he.compiler import batch_group_memory
    from he.runtime import PLAIN_CACHE_BYTES
    _, x, prog, rb = shifted_monet
    low, live = prog.lowered, prog.plan.live
    segments, most, floor = _most_tiles(low, live, rb)
    spilled = allocated_memory(low, live, rb, segments, most, False, True)
    budget = int((spilled + PLAIN_CACHE_BYTES + floor) / 2)
    assert spilled + PLAIN_CACHE_BYTES < budget < floor
    mem = batch_group_memory(low, live, prog.params, budget, segments, keep_inputs=False)
    assert mem.spills and mem.working <= budget
    client = he.Client(prog)
    ct = client.encrypt(x[:4].numpy()).to_bytes()
    with eager_products():
        expected = client.decrypt(he.Server(prog, client.public_context()).run(ct))
    tight = he.Server(prog, client.public_context(), memory_budget=budget)
    got = client.decrypt(tight.run(ct))
    assert tight.tiles and tight.spilled == sum(n for _, n in mem.spills)
    assert np.abs(got - expected).max() <= 0.05 * prog.params.expected_error
    again = he.compile(prog.program, x[:1], calibration=x, packing="batch",
                       memory_budget=budget)
    if again.options.get("kept_apart") == prog.options.get("kept_apart"):
        # the same lowering under the budget: the compiler plans its spills and says so
        assert again.plan.predicted["spills"] and "written to disk" in again.plan.why
    else:
        # the compiler preferred another lowering, priced within the budget (fewer rows held
        # at once), and says what the one that spills would have cost
        assert again.plan.predicted["working_memory_bytes"] <= budget
        assert "lowerings priced" in again.plan.why


@pytest.mark.slow
@settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=hst.integers(0, 10 ** 6), patch=hst.sampled_from([1, 2]), dim=hst.sampled_from([4, 8]),
       shifts=hst.sampled_from([(True,), (True, False), (False, True), (True, True)]),
       pool=hst.booleans(), tiles=hst.sampled_from([4, 8, MAX_TILES]))
def test_random_shifted_token_models_spill_to_the_same_words(seed, patch, dim, shifts, pool,
                                                             tiles):
    """On random token models with spatial shifts, tiles that spill give the ciphertexts of the
    same tiles in memory, word for word, each planned spill written out and read back once."""
    from he.tiling import spills
    x, prog, rb = _random_tokens_compiled(seed, patch, dim, shifts, pool, 16)
    low, live = prog.lowered, prog.plan.live
    segments = find_segments(low, live, rb, keep_inputs=False)
    plan = [(seg, min(seg.components, tiles)) for seg in segments]
    events = sum(v[0].size for seg, k in plan for v in spills(low, seg, k).values())
    if not events:
        return                                  # no row held across a tile here
    _spills_to_the_same_words(prog, x[:3], plan, events)


def test_the_lifts_a_group_runs_are_the_lifts_its_price_counts(compiled, monkeypatch):
    """Steps of sums over inputs at several levels lift the lower ones first (a product with an
    encoded one and a rescale each, on the server's threads): a whole group lifts exactly the
    inputs :func:`he.plan.batch_lifts` counts, and the compiler prices each."""
    from he.backend import Engine
    from he.compiler import shared_values_as_steps
    from he.plan import batch_lifts
    model, x, composed, _ = compiled
    # composed into the maps that read them, the residual sums need no lift: kept as steps
    assert composed.options.get("kept_apart") or not any(
        batch_lifts(composed.lowered, composed.plan.live, composed.options["lazy_products"]))
    with shared_values_as_steps():
        prog = he.compile(model, x[:1], calibration=x, packing="batch",
                    final_map="server")
    low, live = prog.lowered, prog.plan.live
    want = batch_lifts(low, live, prog.options["lazy_products"])
    n_lifts = sum(n for lifts in want for n in lifts.values())
    assert n_lifts > 0                      # the Mu-Layers' residual sums read a lower level
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x[:4].numpy())
    real, seen = Engine.lift, []

    def counted(self, c, level, out=None):
        if self.level(c) != level:
            seen.append((self.level(c), level))
        return real(self, c, level, out)

    monkeypatch.setattr(Engine, "lift", counted)
    got = client.decrypt(server.run(ct))
    assert len(seen) == n_lifts
    assert collections.Counter(lv for lv, _ in seen) == \
        sum((collections.Counter(lifts) for lifts in want), collections.Counter())
    assert np.abs(got - prog.simulate(x[:4].numpy())).max() <= prog.params.expected_error
    # priced: every lift a plaintext product and a rescale (a product alone on a wide chain)
    per = {op for lv, to in seen for op, _ in prog.params.lift_primitives(lv, to)}
    assert per and per <= {"mul_plain", "rescale"}
    assert prog.plan.predicted["counts"]["mul_plain"] >= n_lifts
