"""scripts/device_check.py's attention check for the kernels with attention sinks (gpt-oss on CUDA): its inputs and
its float64 reference, run here against the flash kernels' own schedule in numpy (tests/schedules/flash_emulation.py,
the sink folded where a row's call holds its own key), so that a device call tests the kernels, not the check."""

from __future__ import annotations

import numpy as np
import pytest
from luce_schedules.gpu import flash_prefill as fp

from tests.bench._load import load_script
from tests.schedules.flash_emulation import emulate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("decode", [False, True], ids=["ragged", "decode"])
def test_the_checks_reference_is_the_kernels_schedule_with_the_sink_where_it_folds(decode):
    dc = load_script("device_check")
    h_kv, h_q, d_att = dc.SINK_SHAPES[0]
    rng = np.random.default_rng()
    if decode:
        q_lens, kv_lens, owns, causal, tile = (1, 1, 1), (1, 70, 300), [True, False, True], False, fp.decode_tile(8, 80)
    else:
        q_lens, kv_lens, owns, causal, tile = (17, 100), (17, 100), [True, True], True, fp.default_tile(80, 80)
    q, k, v, folded = dc._sink_inputs(rng, q_lens, kv_lens, h_kv, h_q, d_att, owns)
    want, _ = dc._sink_reference(q, k, v, q_lens, kv_lens, causal, 1 / np.sqrt(d_att), folded, d_att)
    out, _, _ = emulate(q, k, v, q_lens, kv_lens, causal, 1 / np.sqrt(d_att), h_kv, tile, sink_at=d_att)
    plain, _, _ = emulate(q, k, v, q_lens, kv_lens, causal, 1 / np.sqrt(d_att), h_kv, tile)
    rows = np.concatenate([[o] * n for o, n in zip(owns, q_lens, strict=True)])
    assert dc._rel(out[rows, :, :d_att].astype(np.float64), want[rows]) < dc.ATTN_OUT_TOL
    if (~rows).any():  # a decode call whose pages end before the query's key: no sink
        assert dc._rel(plain[~rows, :, :d_att].astype(np.float64), want[~rows]) < dc.ATTN_OUT_TOL
    assert not dc._rel(plain[rows, :, :d_att].astype(np.float64), want[rows]) < dc.ATTN_OUT_TOL  # sinks matter
    assert (out[..., d_att:] == 0).all()  # values are zero in the padding


@pytest.mark.parametrize("shape", load_script("device_check").DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_shapes_without_sinks_check_against_the_decode_tiles_schedule(shape):
    """DECODE_SHAPES: plain rows (no padding, no sink folded) through the same inputs and reference; the decode
    tile's schedule (its warps sharing each step's keys, merged at the end) gives the reference's rows."""
    dc = load_script("device_check")
    h_kv, h_q, d = shape
    rng = np.random.default_rng()
    q_lens, kv_lens = (1, 1, 1), (1, 70, 300)
    q, k, v, folded = dc._sink_inputs(rng, q_lens, kv_lens, h_kv, h_q, d, [True] * 3, columns=0)
    assert q.shape[-1] == d and np.isneginf(folded).all()
    want, _ = dc._sink_reference(q, k, v, q_lens, kv_lens, False, 1 / np.sqrt(d), folded, d)
    out, _, _ = emulate(q, k, v, q_lens, kv_lens, False, 1 / np.sqrt(d), h_kv, fp.decode_tile(h_q // h_kv, d))
    assert dc._rel(out.astype(np.float64), want) < dc.ATTN_OUT_TOL
