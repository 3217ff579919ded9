"""Greedy global imitation: the algorithm on synthetic quadratics (exhaustive and Taylor-shortlist
steps), and the downstream objective on a tiny exported conv net (a = 1/N is the original,
gradients match finite differences, candidate batching is exact, end to end agrees with an
independently masked ONNX model)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from onnxprune.analysis import analyze
from benchmarks.paper_global import DownstreamObjective, greedy_global, taylor_scores
from onnxprune.torch.engine import TorchGraph
from tests.onnx_builders import export_torch, masked_original

# --------------------------------------------------------------------------------------------
# the algorithm on quadratics
# --------------------------------------------------------------------------------------------


class Quadratic:
    """D(a) = (a - t)ᵀQ(a - t), with call counters; grad is ∂D/∂b of D(a + b) at b = 0."""

    def __init__(self, n: int, seed: int, far: float = 0.0) -> None:
        rng = np.random.default_rng(seed)
        m = rng.standard_normal((2 * n, n))
        self.Q = m.T @ m / (2 * n) + 0.1 * np.eye(n)
        t = rng.dirichlet(np.ones(n))
        self.t = t + far * rng.standard_normal(n) if far else t
        self.loss_calls: list[tuple[int, int]] = []  # (K, step)
        self.grad_calls: list[int] = []

    def value(self, a: np.ndarray) -> np.ndarray:
        d = np.atleast_2d(a) - self.t
        return np.einsum("ki,ij,kj->k", d, self.Q, d)

    def losses(self, cands: np.ndarray, step: int) -> np.ndarray:
        self.loss_calls.append((len(cands), step))
        return self.value(cands)

    def grad(self, a: np.ndarray, step: int) -> np.ndarray:
        self.grad_calls.append(step)
        return 2.0 * self.Q @ (a - self.t)


def _replay(q: Quadratic, picks: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(state a(k) before step k, exact losses of all n candidates at step k) along ``picks``."""
    out, counts = [], np.zeros(n)
    for k, i in enumerate(picks):
        a = counts / max(k, 1)
        cands = np.eye(n) if k == 0 else (counts[None, :] + np.eye(n)) / (k + 1)
        out.append((a, q.value(cands)))
        counts[i] += 1
    return out


def test_exact_steps_match_exhaustive_search_and_the_loss_decreases() -> None:
    n = 14
    q = Quadratic(n, seed=1)
    path = greedy_global(q.losses, q.grad, n, max_width=10, exact_until=1000, chunk=5)
    assert not q.grad_calls and path.exact.all()
    assert max(k for k, _ in q.loss_calls) <= 5  # candidates chunked
    assert path.supports[-1] == 10 and path.supports[0] == 1
    assert np.all(np.diff(path.supports) >= 0) and np.all(np.diff(path.supports) <= 1)
    counts = np.zeros(n)
    for k, (_, vals) in enumerate(_replay(q, path.picks, n)):
        assert path.picks[k] == int(np.argmin(vals))
        assert path.losses[k] == pytest.approx(vals.min(), rel=1e-12)
        counts[path.picks[k]] += 1
    np.testing.assert_allclose(path.final, counts / counts.sum())
    assert path.losses[-1] < 0.2 * path.losses[0]
    assert path.losses[-1] < np.median(path.losses)
    # the curve and the states it points to
    for m in range(1, 11):
        a = path.weights(m)
        assert np.count_nonzero(a) == m and a.sum() == pytest.approx(1.0) and not path.padded(m)
        assert path.curve[m] == pytest.approx(q.value(a)[0], rel=1e-12)
        assert path.curve[m] == min(l for l, s in zip(path.losses, path.supports) if s == m)
        np.testing.assert_array_equal(path.support(m), np.flatnonzero(a))
    assert list(path.order) == list(dict.fromkeys(path.picks))
    assert np.isinf(path.curve[11:]).all()


def test_taylor_shortlist_picks_the_exhaustive_neuron_when_the_linear_term_dominates() -> None:
    n = 20
    # far target: the gradient dwarfs the γ² curvature term, so the Taylor ranking is the exact one
    exact = Quadratic(n, seed=2, far=30.0)
    taylor = Quadratic(n, seed=2, far=30.0)
    p_exact = greedy_global(exact.losses, exact.grad, n, 12, exact_until=1000)
    p_taylor = greedy_global(taylor.losses, taylor.grad, n, 12, exact_until=0, shortlist=1)
    assert not p_taylor.exact[1:].any() and p_taylor.exact[0]
    assert taylor.grad_calls == list(range(1, len(p_taylor.picks)))
    assert all(k == 1 for k, step in taylor.loss_calls if step >= 1)  # only the shortlist is evaluated
    k = min(len(p_exact.picks), len(p_taylor.picks), 10)
    np.testing.assert_array_equal(p_taylor.picks[:k], p_exact.picks[:k])
    np.testing.assert_allclose(p_taylor.losses[:k], p_exact.losses[:k], rtol=1e-12)


def test_taylor_shortlist_is_near_exhaustive_once_gamma_is_small() -> None:
    """On a generic quadratic near its optimum the γ² term matters, so the top-5 Taylor shortlist
    holds the exhaustive pick at most (not all) steps k >= 25, and loses little when it misses."""
    n = 30
    q = Quadratic(n, seed=3)
    path = greedy_global(q.losses, q.grad, n, n, exact_until=1000, max_steps=80)
    hits, gaps = [], []
    for k, (a, vals) in enumerate(_replay(q, path.picks, n)):
        if k < 25:
            continue
        top = np.argsort(taylor_scores(a, q.grad(a, k)), kind="stable")[:5]
        hits.append(np.argmin(vals) in top)
        gaps.append(vals[top].min() / vals.min() - 1.0)
    assert len(hits) > 50 and np.mean(hits) >= 0.9 and max(gaps) < 0.1
    # the default settings (exact until 25, then the top 5) reach about the same loss for far less
    q2 = Quadratic(n, seed=3)
    fast = greedy_global(q2.losses, q2.grad, n, n, max_steps=80)
    np.testing.assert_array_equal(fast.picks[:26], path.picks[:26])
    assert not fast.exact[26:].any() and fast.exact[:26].all()
    assert fast.losses[-1] <= 1.1 * path.losses[-1]
    assert fast.evaluations < path.evaluations / 2


def test_taylor_scores_are_the_directional_derivative() -> None:
    q = Quadratic(9, seed=4)
    a = np.random.default_rng(0).dirichlet(np.ones(9))
    eps = 1e-6
    for i in range(9):
        d = np.eye(9)[i] - a
        fd = (q.value(a + eps * d)[0] - q.value(a - eps * d)[0]) / (2 * eps)
        assert taylor_scores(a, q.grad(a, 0))[i] == pytest.approx(2 * fd, rel=1e-6, abs=1e-9)


def test_step_cap_pads_by_the_taylor_score() -> None:
    n = 12
    q = Quadratic(n, seed=5)
    path = greedy_global(q.losses, q.grad, n, max_width=8, exact_until=1000, max_steps=3)
    m = int(path.supports[-1])
    assert m < 8 and path.padded(8) and not path.padded(m)
    a = path.weights(8)
    np.testing.assert_array_equal(a, path.weights(m))
    keep = path.support(8)
    assert len(keep) == 8 and set(np.flatnonzero(a)) <= set(keep)
    score = taylor_scores(a, q.grad(a, 0))
    extra = sorted(set(keep) - set(np.flatnonzero(a)))
    others = sorted(set(range(n)) - set(keep))
    assert max(score[extra]) <= min(score[others])
    with pytest.raises(ValueError):
        path.weights(0)
    with pytest.raises(ValueError):
        path.support(n + 1)
    with pytest.raises(ValueError):
        greedy_global(q.losses, q.grad, n, n + 1)


# --------------------------------------------------------------------------------------------
# the downstream objective on a tiny exported network
# --------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1, stride=2)
        self.conv3 = nn.Conv2d(6, 4, 1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.conv2(h))
        h = torch.relu(self.conv3(h))
        return self.fc(torch.flatten(h, 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    torch.manual_seed(0)
    net = _Tiny()
    with torch.no_grad():
        for bn in [net.bn1]:
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
    path = export_torch(net, tmp_path_factory.mktemp("tiny") / "tiny.onnx", (1, 3, 8, 8))
    model = onnx.load(str(path))
    analysis = analyze(model)
    group = next(g for g in analysis.groups if g.prunable and g.channels == 8)
    (use,) = group.consumers
    flat = next(n for n in model.graph.node if n.op_type == "Flatten")
    conv3_out = flat.input[0]
    x = np.random.default_rng(0).standard_normal((24, 3, 8, 8)).astype(np.float32)
    full = TorchGraph(model, outputs=[use.tensor, conv3_out, flat.output[0], "logits"]).to(torch.float64)
    with torch.no_grad():
        h, c3, fl, logits = (t.numpy() for t in full(torch.from_numpy(x).double()))
    return {"model": model, "analysis": analysis, "group": group, "tensor": use.tensor,
            "axis": group.tensors[use.tensor][0], "x": x, "h": h, "logits": logits, "conv3": conv3_out, "c3": c3,
            "flat": flat.output[0], "fl": fl}


def _objective(tiny: dict, **kw) -> DownstreamObjective:
    kw.setdefault("dtype", torch.float64)
    kw.setdefault("device", "cpu")
    return DownstreamObjective(tiny["model"], {tiny["tensor"]: tiny["h"]}, [(tiny["tensor"], tiny["axis"])],
                               {"logits": tiny["logits"]}, **kw)


def _kl(ref: np.ndarray, out: np.ndarray) -> float:
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(out.astype(np.float64))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("loss", ["kl", "mse"])
def test_uniform_weights_are_the_original_network(tiny, loss) -> None:
    obj = _objective(tiny, loss=loss, batch_size=10)
    assert obj.n_channels == 8 and obj.graph.input_names == [tiny["tensor"]]
    uniform = np.full(8, 1 / 8)
    assert obj.full_loss(uniform) < 1e-20
    assert np.all(obj.losses(uniform[None], 3) < 1e-20)
    # float32 too
    obj32 = _objective(tiny, loss=loss, dtype=torch.float32)
    assert obj32.full_loss(uniform) < 1e-7  # float32 rounding of the logits: 2e-9 with this torch on 2 cores
    # a single channel is not
    assert obj.full_loss(np.eye(8)[2]) > 1e-3


def test_grad_matches_central_finite_differences(tiny) -> None:
    obj = _objective(tiny, batch_size=10, max_rows=4)  # the gradient accumulates over row chunks
    rng = np.random.default_rng(1)
    a = rng.dirichlet(np.ones(8))
    a[[1, 5]] = 0.0
    a /= a.sum()
    step = 7
    r = obj.grad(a, step)
    eps = 1e-6
    plus = obj.losses(a[None] + eps * np.eye(8), step)
    minus = obj.losses(a[None] - eps * np.eye(8), step)
    np.testing.assert_allclose(r, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-10)
    # another step draws another mini-batch (so another gradient), the same step the same one
    assert not np.array_equal(obj.batch(step), obj.batch(step + 1))
    np.testing.assert_array_equal(obj.batch(step), _objective(tiny, batch_size=10).batch(step))
    assert not np.allclose(obj.grad(a, step + 1), r)
    np.testing.assert_array_equal(obj.grad(a, step), r)


def test_candidate_batching_equals_one_at_a_time(tiny) -> None:
    rng = np.random.default_rng(2)
    cands = rng.dirichlet(np.ones(8), size=7)
    one = _objective(tiny, batch_size=10, max_rows=10)  # one candidate per forward
    many = _objective(tiny, batch_size=10, max_rows=30)  # three per forward
    alone = np.array([one.losses(c[None], 4)[0] for c in cands])
    np.testing.assert_allclose(many.losses(cands, 4), alone, rtol=1e-12)
    # the mini-batch loss is the loss of those samples: same as full_loss on the sub-set
    idx = one.batch(4)
    sub = DownstreamObjective(tiny["model"], {tiny["tensor"]: tiny["h"][idx]}, [(tiny["tensor"], tiny["axis"])],
                              {"logits": tiny["logits"][idx]}, dtype=torch.float64, device="cpu")
    np.testing.assert_allclose([sub.full_loss(c) for c in cands], alone, rtol=1e-12)


def test_a_flattened_channel_tensor_masks_blocks(tiny) -> None:
    """Masking conv3's output (4 channels) equals masking the Flatten output (4 blocks of 16)."""
    common = {"dtype": torch.float64, "device": "cpu", "batch_size": None}
    on_conv = DownstreamObjective(tiny["model"], {tiny["conv3"]: tiny["c3"]}, [(tiny["conv3"], 1)],
                                  {"logits": tiny["logits"]}, **common)
    on_flat = DownstreamObjective(tiny["model"], {tiny["flat"]: tiny["fl"]}, [(tiny["flat"], 1)],
                                  {"logits": tiny["logits"]}, n_channels=4, **common)
    cands = np.random.default_rng(3).dirichlet(np.ones(4), size=5)
    np.testing.assert_allclose(on_flat.losses(cands, 0), on_conv.losses(cands, 0), rtol=1e-12)
    np.testing.assert_allclose(on_flat.grad(cands[0], 0), on_conv.grad(cands[0], 0), rtol=1e-10)


def test_bad_inputs_are_reported(tiny) -> None:
    with pytest.raises(ValueError, match="loss"):
        _objective(tiny, loss="ce")
    with pytest.raises(Exception, match="not evaluated after the cut|not in the graph"):
        DownstreamObjective(tiny["model"], {tiny["flat"]: tiny["fl"]}, [(tiny["tensor"], 1)],
                            {"logits": tiny["logits"]}, n_channels=8)
    with pytest.raises(Exception, match="sample counts"):
        DownstreamObjective(tiny["model"], {tiny["tensor"]: tiny["h"][:5]}, [(tiny["tensor"], 1)],
                            {"logits": tiny["logits"]})


def test_end_to_end_matches_the_masked_onnx_model(tiny) -> None:
    obj = _objective(tiny, batch_size=None)  # every step on all samples: step losses are full losses
    n = 5
    path = greedy_global(obj.losses, obj.grad, obj.n_channels, n, exact_until=2, shortlist=3)
    assert path.supports[-1] == n and not path.exact[3:].any()
    a = path.weights(n)
    assert np.count_nonzero(a) == n
    assert path.curve[n] == pytest.approx(obj.full_loss(a), rel=1e-10)
    # independently: the original ONNX model with the consumer's input columns scaled by N·a, run by ORT
    masked = masked_original(tiny["analysis"].graph, tiny["group"], 8 * a)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(masked.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    (out,) = sess.run(["logits"], {"input": tiny["x"]})
    assert _kl(tiny["logits"], out) == pytest.approx(obj.full_loss(a), rel=1e-4, abs=1e-7)
    # greedy beats the best single channel and random choices of the same width
    assert path.curve[n] < path.curve[1]
    rng = np.random.default_rng(0)
    rand = [obj.full_loss(np.bincount(rng.choice(8, n, replace=False), minlength=8) / n) for _ in range(5)]
    assert path.curve[n] < np.median(rand)
