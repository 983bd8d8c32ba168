"""The baselines of FedDG-Benchmark and FL-bench: FedSAM (Qu et al., ICML 2022),
FedGMA (Tenison et al., TMLR 2023) and FedIIR (Guo et al., ICML 2023): their
equations on hand-computed values, and FedGMA at tau = 0 against FedAvg
through the engine."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_cfg, tiny_federation

from rayfed_dg.errors import ConfigError
from rayfed_dg.methods import ClientContext, ClientUpdate, build_method
from rayfed_dg.methods.fedgma import SIGN, gma_mask
from rayfed_dg.methods.fedsam import sam_perturbation


def _ctx():
    return ClientContext(client_id=0, round=1, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                         num_samples=4)


def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _ce_grad(W, b, x, y):
    """d CE / d (W, b) of logits x W^T + b, by hand: G = (softmax - onehot) / B."""
    G = (_softmax(x @ W.T + b) - np.eye(W.shape[0])[y]) / len(y)
    return G.T @ x, G.sum(0)


X = np.array([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0], [2.0, 0.5, -1.0], [-1.0, -1.0, 0.0]])
Y = np.array([0, 1, 1, 0])
W0 = np.array([[0.2, -0.1, 0.3], [-0.4, 0.5, 0.1]])
B0 = np.array([0.05, -0.05])


def _linear():
    m = nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(W0, dtype=torch.float32))
        m.bias.copy_(torch.tensor(B0, dtype=torch.float32))
    return m


def test_sam_perturbation_is_rho_over_the_norm_of_all_tensors():
    g = [torch.tensor([3.0, 0.0]), None, torch.tensor([[4.0]])]
    e = sam_perturbation(g, 0.5)
    assert e[1] is None
    assert torch.allclose(e[0], torch.tensor([0.3, 0.0])) and torch.allclose(e[2], torch.tensor([[0.4]]))  # ||g|| = 5


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fedsam_step_is_sgd_from_w_with_the_gradient_at_w_plus_e(wd):
    rho, lr = 0.5, 0.1
    cfg = tiny_cfg("method.name=fedsam", f"method.rho={rho}", f"training.lr={lr}", "training.momentum=0",
                   f"training.weight_decay={wd}")
    method = build_method(cfg, 3)
    model = _linear()
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    res = method.local_train(model, lambda: iter([(x, y)]), _ctx())
    gW, gb = _ce_grad(W0, B0, X, Y)
    norm = np.sqrt((gW ** 2).sum() + (gb ** 2).sum())
    We, be = W0 + rho * gW / norm, B0 + rho * gb / norm  # w + e(w)
    sW, sb = _ce_grad(We, be, X, Y)  # the SAM gradient
    np.testing.assert_allclose(model.weight.detach().numpy(), W0 - lr * (sW + wd * W0), atol=1e-6)
    np.testing.assert_allclose(model.bias.detach().numpy(), B0 - lr * (sb + wd * B0), atol=1e-6)
    assert res.steps == 1


def test_fedsam_updates_batchnorm_statistics_at_w_only():
    cfg = tiny_cfg("method.name=fedsam", "method.rho=2.0", "training.lr=0.1", "training.momentum=0",
                   "training.weight_decay=0")
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    model = nn.Sequential(_linear(), nn.BatchNorm1d(2), nn.Linear(2, 2))
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    h = X @ W0.T + B0  # the BatchNorm's input at w
    method.local_train(model, lambda: iter([(x, y)]), _ctx())
    bn = model[1]
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * h.mean(0), atol=1e-6)
    np.testing.assert_allclose(bn.running_var.numpy(), 0.9 + 0.1 * h.var(0, ddof=1), atol=1e-6)
    assert bn.momentum == 0.1 and int(bn.num_batches_tracked) == 1  # restored after the perturbed pass


def _kl(p, q):
    """KL(p || q) of row distributions, batch mean."""
    return float((p * (np.log(p) - np.log(q))).sum() / len(p))


def _start(gen, shape, dist):
    """FedLGF's random start as the code draws it from the client's generator, in float64."""
    d = torch.randn(shape, generator=gen) if dist == "normal" else torch.rand(shape, generator=gen) - 0.5
    return d.double().numpy()


def _adv_by_hand(f, z, W, b, kind, init, grad, delta):
    """FedLGF's adv(h, f) by hand (fedsam's docstring), from the random start ``delta`` as drawn: the KL gradient
    G = (softmax(z') - p)^T f / B with respect to the perturbed weight, through the SVD's chain rule for
    ``singular`` (d s_i = u_i^T dW v_i, times init where relu passes S_i + init d_i), one unit step of it."""
    p, B = _softmax(z), len(f)
    if kind == "singular":
        U, S, Vh = np.linalg.svd(W, full_matrices=False)
        d = delta / (np.linalg.norm(delta) + 1e-8)
        s = np.maximum(S + init * d, 0.0)
        zp = f @ (U @ np.diag(s) @ Vh).T + b
        dW = (_softmax(zp) - p).T @ f / B
        g = np.array([U[:, i] @ dW @ Vh[i] for i in range(len(S))]) * init * (S + init * d > 0)
        g = g / (np.linalg.norm(g) + 1e-8)
        return f @ (U @ np.diag(np.maximum(S + grad * g, 0.0)) @ Vh).T + b
    d = delta / (np.linalg.norm(delta, axis=1, keepdims=True) + 1e-8)
    zp = f @ (W + init * d).T + b
    g = init * (_softmax(zp) - p).T @ f / B
    g = g / (np.linalg.norm(g, axis=1, keepdims=True) + 1e-8)
    return f @ (W + grad * g).T + b


@pytest.mark.parametrize("kind,dist,init,grad", [("singular", "normal", 10.0, 0.1), ("singular", "uniform", 0.7, 0.3),
                                                 ("weight", "normal", 0.5, 0.2), ("weight", "uniform", 2.0, 0.05)])
def test_fedlgf_adversarial_head_is_one_kl_ascent_step_from_a_random_start(kind, dist, init, grad):
    from rayfed_dg.methods.fedsam import adversarial_logits
    f, z = torch.tensor(X, dtype=torch.float64), torch.tensor([[1.0, -1.0], [0.0, 2.0], [0.5, 0.5], [-1.0, 0.3]])
    W, b = torch.tensor(W0 * 3), torch.tensor(B0)
    delta = _start(torch.Generator().manual_seed(0), (2,) if kind == "singular" else (2, 3), dist)
    got = adversarial_logits(f.float(), z, W.float(), b.float(), kind, init, grad, dist, torch.Generator().manual_seed(0))
    want = _adv_by_hand(X, z.numpy().astype(np.float64), W0 * 3, B0, kind, init, grad, delta)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5)
    if (kind, init) == ("singular", 10.0):  # the README's scale: relu clips one singular value of the start
        S = np.linalg.svd(W0 * 3)[1]
        assert sorted((S + init * delta / np.linalg.norm(delta)) > 0) == [False, True]


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.a * x


@pytest.mark.parametrize("rho,local,glob,kind,dist", [
    (0.0, 0.3, 0.7, "singular", "normal"), (0.0, 0.0, 0.5, "weight", "normal"), (0.0, 0.4, 0.0, "singular", "uniform"),
    (0.2, 0.3, 0.7, "singular", "normal"), (0.2, 0.6, 0.2, "weight", "uniform")])
def test_fedlgf_terms_step_two_batches_by_hand(rho, local, glob, kind, dist):
    """J = CE + local KL(softmax(z_l) || softmax(z)) + global KL(softmax(z_g) || softmax(z)), z_l from the local
    head, z_g from the round's global model (frozen at round start: the second step's differs from the local one),
    both constants; the draws from the client's generator, local before global, pass by pass; SAM on J when
    rho > 0.  The body scales its input by a (from 1), so the global model's features (x) differ from the local
    ones (a x) after the first step.  Two SGD steps, every gradient by hand:
    dJ/dz = G = (q - onehot + local (q - p_l) + global (q - p_g)) / B, dJ/dW = G^T f, dJ/da = sum((G W) * x)."""
    lr, init, grad = 0.5, 10.0 if kind == "singular" else 0.5, 0.1
    cfg = tiny_cfg("method.name=fedsam", f"method.rho={rho}", f"method.local_flatness={local}",
                   f"method.global_flatness={glob}", f"method.perturb={kind}", f"method.perturb_init={init}",
                   f"method.perturb_grad={grad}", f"method.perturb_dist={dist}", f"training.lr={lr}",
                   "training.momentum=0", "training.weight_decay=0")
    method = build_method(cfg, 3)
    from rayfed_dg.models.split import SplitModel
    model = SplitModel(_Scale(), _linear())
    batches = [(torch.tensor(X[:2], dtype=torch.float32), torch.tensor(Y[:2])),
               (torch.tensor(X[1:], dtype=torch.float32), torch.tensor(Y[1:]))]
    ctx = _ctx()
    method.round_start(model, ctx)
    res = method.local_train(model, lambda: iter(batches), ctx)

    gen, shape = torch.Generator().manual_seed(0), (2,) if kind == "singular" else (2, 3)

    def j_and_grad(W, b, a, x, y):
        f = a * x
        z = f @ W.T + b
        q, onehot = _softmax(z), np.eye(2)[y]
        J, G = -np.log(q[np.arange(len(y)), y]).mean(), q - onehot
        for lam, (fh, Wh, bh) in ((local, (f, W, b)), (glob, (x, W0, B0))):  # the global model: a = 1
            if lam > 0:
                pa = _softmax(_adv_by_hand(fh, z, Wh, bh, kind, init, grad, _start(gen, shape, dist)))
                J, G = J + lam * _kl(pa, q), G + lam * (q - pa)
        G = G / len(y)
        return J, G.T @ f, G.sum(0), ((G @ W) * x).sum()

    W, b, a, losses = W0.copy(), B0.copy(), 1.0, []
    for x, y in ((X[:2], Y[:2]), (X[1:], Y[1:])):
        J, gW, gb, ga = j_and_grad(W, b, a, x, y)
        if rho > 0:
            n = np.sqrt((gW ** 2).sum() + (gb ** 2).sum() + ga ** 2)
            J, gW, gb, ga = j_and_grad(W + rho * gW / n, b + rho * gb / n, a + rho * ga / n, x, y)
        losses.append(J * len(y))
        W, b, a = W - lr * gW, b - lr * gb, a - lr * ga
    np.testing.assert_allclose(model.head.weight.detach().numpy(), W, atol=2e-5)
    np.testing.assert_allclose(model.head.bias.detach().numpy(), b, atol=2e-5)
    assert model.body.a.item() == pytest.approx(a, abs=2e-5) and a != 1.0
    assert res.loss == pytest.approx(sum(losses) / 5, rel=1e-4)


def test_fedlgf_global_model_is_evaluated_with_its_own_statistics_and_left_as_received():
    from rayfed_dg.methods.fedsam import GLOBAL
    from rayfed_dg.models.split import SplitModel
    method = build_method(tiny_cfg("method.name=fedsam", "method.rho=0", "method.global_flatness=1.0"), 3)
    model = SplitModel(nn.BatchNorm1d(3), _linear())
    ctx = _ctx()
    method.round_start(model, ctx)
    glob, received = ctx.scratch[GLOBAL], {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    method.local_train(model, lambda: iter([(x, y), (x, y)]), ctx)
    assert not torch.equal(model.body.running_mean, received["body.running_mean"])  # the local model trained
    for k, v in glob.state_dict().items():  # the running statistics too: evaluation mode, no gradient step
        assert torch.equal(v, received[k]), k
    # its features are those of evaluation mode: (x - running mean 0) / sqrt(running var 1 + eps)
    np.testing.assert_allclose(glob.features(x).numpy(), X / np.sqrt(1 + 1e-5), rtol=1e-6)


def test_fedlgf_kl_is_taken_in_fp32_from_bf16_logits():
    from rayfed_dg.methods.fedsam import flatness_kl
    z = torch.tensor([[3.1, -2.7, 0.4], [0.02, 0.01, -0.03]]).bfloat16()
    zp = torch.tensor([[2.9, -2.5, 0.5], [0.0, 0.05, -0.04]])
    got = flatness_kl(z, zp)
    q, pa = _softmax(z.double().numpy()), _softmax(zp.double().numpy())  # z as bf16 rounded it, then exact
    assert got.item() == pytest.approx(_kl(pa, q), rel=1e-4)


@pytest.mark.parametrize("terms", [["method.local_flatness=0.1"], ["method.global_flatness=0.1"],
                                   ["method.local_flatness=0.5", "method.global_flatness=2.0"], []])
def test_fedlgf_refuses_a_head_it_cannot_perturb_only_with_a_term_on(terms):
    from rayfed_dg.models.split import SplitModel
    method = build_method(tiny_cfg("method.name=fedsam", *terms), 3)
    model = SplitModel(nn.Identity(), _linear())
    model.head = nn.Sequential(_linear())
    if not terms:  # plain FedSAM perturbs every weight, whatever the head
        method.round_start(model, _ctx())
        return
    with pytest.raises(ConfigError, match="fedsam's flatness terms perturb a linear head; this model's head is Sequential"):
        method.round_start(model, _ctx())


def test_fedsam_rho_zero_without_flatness_is_plain_sgd_and_may_train_in_fp16():
    assert tiny_cfg("method.name=fedsam", "method.rho=0", "training.precision=fp16").method.params.rho == 0
    method = build_method(tiny_cfg("method.name=fedsam", "method.rho=0", "training.lr=0.1", "training.momentum=0",
                                   "training.weight_decay=0"), 3)
    model = _linear()
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    method.local_train(model, lambda: iter([(x, y)]), _ctx())
    gW, gb = _ce_grad(W0, B0, X, Y)
    np.testing.assert_allclose(model.weight.detach().numpy(), W0 - 0.1 * gW, atol=1e-6)
    np.testing.assert_allclose(model.bias.detach().numpy(), B0 - 0.1 * gb, atol=1e-6)


def test_fedsam_refuses_fp16():
    with pytest.raises(ConfigError, match="fedsam cannot train in training.precision fp16"):
        tiny_cfg("method.name=fedsam", "training.precision=fp16")


# ------------------------------------------------------------------ FedGMA

def test_gma_mask_is_one_at_or_above_tau_and_the_agreement_below():
    # 4 clients: sign sums 4, -2, 1, 0, -3 give agreements 1, 0.5, 0.25, 0, 0.75
    m = gma_mask(np.array([4, -2, 1, 0, -3]), 4, 0.5)
    np.testing.assert_array_equal(m, [1.0, 1.0, 0.25, 0.0, 1.0])
    np.testing.assert_array_equal(gma_mask(np.array([4, -2, 1, 0, -3]), 4, 0.8), [1.0, 0.5, 0.25, 0.0, 0.75])


def _update(cid, n, signs):
    return ClientUpdate(client=cid, num_samples=n, update={}, private={}, payload={SIGN: np.array(signs, np.int8)},
                        train_loss=0.0, seconds=0.0)


def test_fedgma_assembles_w_plus_eta_mask_times_the_weighted_update():
    cfg = tiny_cfg("method.name=fedgma", "method.mask_threshold=0.9", "method.step_size=0.5")
    method = build_method(cfg, 4)  # four clients, three of whose updates arrived: |S| = 3 divides
    method.param_keys = ["a", "b"]  # a: 2 coordinates, b: 1 (trainable()'s order)
    prev = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)}
    # three clients of 1, 1 and 2 samples: w_k - w per coordinate
    deltas = [np.array([0.3, -0.2, 1.0]), np.array([0.1, 0.4, 2.0]), np.array([0.2, -0.1, 0.5])]
    sizes = [1, 1, 2]
    avg = sum(n * d for n, d in zip(sizes, deltas)) / 4  # [0.2, 0.0, 1.0]
    average = {"a": (prev["a"] + avg[:2]).astype(np.float32), "b": (prev["b"] + avg[2:]).astype(np.float32)}
    results = [_update(i, n, np.sign(d)) for i, (n, d) in enumerate(zip(sizes, deltas))]
    out = method.assemble_global(1, results, average, prev, {})
    # agreements: |3|/3 = 1, |-1|/3, 3/3 -> masks 1, 1/3, 1
    np.testing.assert_allclose(out["a"], [1.0 + 0.5 * 0.2, 2.0 + 0.5 * (1 / 3) * 0.0], atol=1e-6)
    np.testing.assert_allclose(out["b"], [0.5 * 1.0], atol=1e-6)
    # second coordinate of "a" with a non-zero average: shift it and check the damping
    average["a"][1] = 2.3
    out = method.assemble_global(1, results, average, prev, {})
    np.testing.assert_allclose(out["a"][1], 2.0 + 0.5 * (1 / 3) * 0.3, atol=1e-6)


def test_fedgma_uploads_the_sign_of_its_own_change():
    method = build_method(tiny_cfg("method.name=fedgma"), 3)
    model = _linear()
    ctx = _ctx()
    method.round_start(model, ctx)
    with torch.no_grad():
        model.weight[0, 1] += 0.5
        model.weight[1, 2] -= 0.25
    sign = method.upload_payload(model, ctx)[SIGN]
    assert sign.dtype == np.int8 and sign.tolist() == [0, 1, 0, 0, 0, -1, 0, 0]  # weight (row-major), then bias


def test_fedgma_refuses_a_server_optimizer():
    with pytest.raises(ConfigError, match="server.optimizer fedadam has nothing to step: fedgma"):
        tiny_cfg("method.name=fedgma", "server.optimizer=fedadam")


@pytest.mark.slow
def test_fedgma_with_tau_zero_is_fedavg_bit_for_bit(tiny_ds, engine_host):
    """tau = 0 and eta = 1: every mask is 1 and w + (avg - w) in float64 is avg."""
    common = ["training.rounds=2", "training.local_steps=2", "data.limit_per_domain=60"]
    host = engine_host(tiny_ds, 1)
    gma = tiny_federation(tiny_ds, "texture", "method.name=fedgma", "method.mask_threshold=0", *common, host=host)
    avg = tiny_federation(tiny_ds, "texture", "method.name=fedavg", *common, host=host)
    key = lambda res: [(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"]) for m in res.metrics]  # noqa: E731
    assert key(gma) == key(avg)
    damped = tiny_federation(tiny_ds, "texture", "method.name=fedgma", "method.mask_threshold=1", *common, host=host)
    assert key(damped) != key(avg)


# ------------------------------------------------------------------ FedIIR

class _Split(nn.Module):
    """features (a fixed linear map) and a linear head, as models/split.py's SplitModel."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.head = _linear()

    def forward(self, x):
        return self.head(self.body(x))


V0 = np.array([[0.5, 0.1, -0.2], [0.0, 0.3, 0.4], [-0.3, 0.2, 0.1]])
C0 = np.array([0.1, 0.0, -0.1])


def _split_model():
    m = _Split()
    with torch.no_grad():
        m.body.weight.copy_(torch.tensor(V0, dtype=torch.float32))
        m.body.bias.copy_(torch.tensor(C0, dtype=torch.float32))
    return m


def _iir_objective(theta, gbar, lam):
    """CE + lam ||grad_head CE - gbar||^2 in numpy, theta = (V, c, W, b) flat."""
    V, c = theta[:9].reshape(3, 3), theta[9:12]
    W, b = theta[12:18].reshape(2, 3), theta[18:20]
    f = X @ V.T + c
    z = f @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ce = -np.log(p[np.arange(len(Y)), Y]).mean()
    gW, gb = _ce_grad(W, b, f, Y)
    return ce + lam * ((np.concatenate([gW.ravel(), gb]) - gbar) ** 2).sum()


def test_fediir_local_step_descends_the_penalised_objective_by_hand():
    """One SGD step on CE + penalty ||grad_theta CE - g_bar||^2, its gradient
    (through grad_theta CE: double backpropagation) by central differences of
    the objective written out in numpy."""
    lam, lr = 0.7, 0.1
    cfg = tiny_cfg("method.name=fediir", f"method.penalty={lam}", f"training.lr={lr}", "training.momentum=0",
                   "training.weight_decay=0")
    method = build_method(cfg, 3)
    model = _split_model()
    gbar = np.array([0.05, -0.1, 0.2, 0.0, 0.1, -0.05, 0.02, -0.02])
    ctx = _ctx()
    ctx.payload = {"fediir_grad_mean": gbar.astype(np.float32)}
    method.round_start(model, ctx)
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    theta0 = np.concatenate([V0.ravel(), C0, W0.ravel(), B0])
    eps = 1e-6
    grad = np.array([(_iir_objective(theta0 + eps * e, gbar, lam) - _iir_objective(theta0 - eps * e, gbar, lam))
                     / (2 * eps) for e in np.eye(20)])
    method.local_train(model, lambda: iter([(x, y)]), ctx)
    got = torch.cat([p.detach().reshape(-1) for p in (model.body.weight, model.body.bias, model.head.weight,
                                                      model.head.bias)]).numpy()
    np.testing.assert_allclose(got, theta0 - lr * grad, atol=2e-6)
    # the penalty moved the body too (through the features in grad_theta CE), not only the head
    plain = theta0 - lr * np.array([(_iir_objective(theta0 + eps * e, gbar, 0.0)
                                     - _iir_objective(theta0 - eps * e, gbar, 0.0)) / (2 * eps) for e in np.eye(20)])
    assert np.abs(got[:12] - plain[:12]).max() > 1e-4


def test_fediir_prepare_sums_the_head_gradient_of_each_batch():
    cfg = tiny_cfg("method.name=fediir", "training.batch_size=3")
    method = build_method(cfg, 3)
    model = _split_model()
    xs, ys = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    ctx = _ctx()
    ctx.indices = np.arange(4)
    ctx.fetch = lambda idx: (xs[torch.as_tensor(idx)], ys[torch.as_tensor(idx)])
    order = ctx.indices[torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy()]
    out = method.round_prepare(model, ctx)
    f = X @ V0.T + C0
    expect = np.zeros(8)
    for part in (order[:3], order[3:]):  # batches of 3 and 1
        gW, gb = _ce_grad(W0, B0, f[part], Y[part])
        expect += np.concatenate([gW.ravel(), gb])
    np.testing.assert_allclose(out["fediir_grad_sum"], expect, atol=1e-6)
    assert out["fediir_batches"].tolist() == [2]
    ctx.generator = torch.Generator().manual_seed(0)
    capped = build_method(tiny_cfg("method.name=fediir", "training.batch_size=3", "method.grad_batches=1"), 3)
    assert capped.round_prepare(model, ctx)["fediir_batches"].tolist() == [1]


def test_fediir_server_keeps_an_ema_of_the_mean_batch_gradient():
    method = build_method(tiny_cfg("method.name=fediir", "method.ema=0.9"), 4)
    state: dict = {}
    prepared = {0: {"fediir_grad_sum": np.array([2.0, 5.0]), "fediir_batches": np.array([2])},
                3: {"fediir_grad_sum": np.array([1.0, -1.0]), "fediir_batches": np.array([1])}}
    out = method.server_payloads(1, [0, 3], state, None, {}, prepared)
    first = 0.1 * np.array([3.0, 4.0]) / 3  # from 0: (1 - ema) * (sum of sums / batches)
    np.testing.assert_allclose(out[3]["fediir_grad_mean"], first)
    assert sorted(out) == [0, 3]
    out = method.server_payloads(2, [1], state, None, {}, {1: {"fediir_grad_sum": np.array([1.0, -0.5]),
                                                               "fediir_batches": np.array([5])}})
    np.testing.assert_allclose(out[1]["fediir_grad_mean"], 0.9 * first + 0.1 * np.array([0.2, -0.1]), atol=1e-7)


# ------------------------------------------------------------------ FedADG

ADG_SMALL = ["method.name=fedadg", "method.noise_dim=6", "method.gen_hidden=12", "method.rp_size=5",
             "method.disc_hidden=7"]


def test_fedadg_losses_by_hand():
    from rayfed_dg.methods.fedadg import discriminator_loss, encoder_loss, generator_loss

    d_ref, d_feat = torch.tensor([0.2, 0.9]), torch.tensor([0.5, 0.1])
    # D: reference -> 1, features -> 0; F: features -> 1; G: reference -> 0
    assert float(discriminator_loss(d_ref, d_feat)) == pytest.approx(((0.64 + 0.25) + (0.01 + 0.01)) / 2)
    assert float(encoder_loss(d_feat)) == pytest.approx((0.25 + 0.81) / 2)
    assert float(generator_loss(d_ref)) == pytest.approx((0.04 + 0.81) / 2)


def _adg(*sets):
    import copy

    cfg = tiny_cfg(*ADG_SMALL, "training.momentum=0", "training.weight_decay=0", *sets)
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    model = method.build_model(10)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 16, 16, generator=g), torch.arange(6) % 10
    return method, model, copy.deepcopy(model), x, y


def _opts(method, model, lr_task, lr_d, lr_g):
    from rayfed_dg.methods.fedadg import DISC, GEN

    task = [q for n, q in model.named_parameters() if not n.startswith((GEN, DISC))]
    sgd = lambda ps, lr: torch.optim.SGD(ps, lr=lr)  # noqa: E731
    return sgd(task, lr_task), sgd(getattr(model, DISC).parameters(), lr_d), sgd(getattr(model, GEN).parameters(), lr_g)


def _changed(a, b, prefix):
    return [k for k, v in a.state_dict().items() if k.startswith(prefix) and not torch.equal(v, b.state_dict()[k])]


def test_fedadg_discriminator_step_tells_the_reference_from_eval_mode_features():
    from rayfed_dg.methods.fedadg import discriminator_loss

    method, model, ref_model, x, y = _adg()
    ctx = _ctx()
    method.adversarial_step(model, x, y, ctx, *_opts(method, model, 0.0, 0.1, 0.0))
    # by hand: the same noise, features of the model in evaluation mode, one SGD step on D alone
    u = torch.rand(6, 6, generator=torch.Generator().manual_seed(0))
    ys = F.one_hot(y, 10).float() * 0.7
    ref_model.eval()
    with torch.no_grad():
        feat, ref = ref_model.features(x), ref_model.fedadg_generator(ys, u)
    d = ref_model.fedadg_discriminator
    loss = discriminator_loss(d(ys, ref), d(ys, feat))
    grads = torch.autograd.grad(loss, list(d.parameters()))
    got = dict(model.fedadg_discriminator.named_parameters())
    for (name, q), g in zip(d.named_parameters(), grads):
        assert torch.allclose(got[name], q - 0.1 * g, atol=1e-6), name
    # nothing else moved, and BatchNorm statistics were not touched by D's step: they are one training-mode
    # forward's (the F step's, at lr 0)
    assert _changed(model, ref_model, "fedadg_generator") == []
    ref_model.train()
    ref_model.features(x)
    buffers = [k for k, v in model.state_dict().items() if "running" in k]
    assert buffers and all(torch.equal(model.state_dict()[k], ref_model.state_dict()[k]) for k in buffers)
    assert all(torch.equal(a, b) for (n, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters())
               if not n.startswith("fedadg"))


def test_fedadg_feature_step_weighs_classification_against_alignment():
    from rayfed_dg.methods.fedadg import encoder_loss

    method, model, ref_model, x, y = _adg("method.alpha=0.6", "method.label_smoothing=0.2")
    method.adversarial_step(model, x, y, _ctx(), *_opts(method, model, 0.1, 0.0, 0.0))
    ys = F.one_hot(y, 10).float() * 0.7
    ref_model.train()
    feat = ref_model.features(x)
    ce = F.cross_entropy(ref_model.head(feat), y, label_smoothing=0.2)
    loss = 0.6 * ce + 0.4 * encoder_loss(ref_model.fedadg_discriminator(ys, feat))
    task = [(n, q) for n, q in ref_model.named_parameters() if not n.startswith("fedadg")]
    grads = torch.autograd.grad(loss, [q for _, q in task])
    got = dict(model.named_parameters())
    for (n, q), g in zip(task, grads):
        assert torch.allclose(got[n], q - 0.1 * g, atol=1e-6), n
    assert _changed(model, ref_model, "fedadg") == []  # D and G kept still


def test_fedadg_generator_step_moves_the_reference_towards_the_features():
    from rayfed_dg.methods.fedadg import generator_loss

    method, model, ref_model, x, y = _adg()
    method.adversarial_step(model, x, y, _ctx(), *_opts(method, model, 0.0, 0.0, 0.1))
    u = torch.rand(6, 6, generator=torch.Generator().manual_seed(0))
    ys = F.one_hot(y, 10).float() * 0.7
    gen = ref_model.fedadg_generator
    loss = generator_loss(ref_model.fedadg_discriminator(ys, gen(ys, u)))
    grads = torch.autograd.grad(loss, list(gen.parameters()))
    got = dict(model.fedadg_generator.named_parameters())
    for (n, q), g in zip(gen.named_parameters(), grads):
        assert torch.allclose(got[n], q - 0.1 * g, atol=1e-6), n
    assert any(g.abs().max() > 1e-6 for g in grads)  # G did learn: its output is not detached
    assert _changed(model, ref_model, "fedadg_discriminator") == []


def test_fedadg_keeps_its_discriminator_private_and_shares_the_generator():
    method, model, _, _, _ = _adg()
    keys = model.state_dict()
    assert method.private_keys(model) == method.local_keys(model) == {k for k in keys
                                                                      if k.startswith("fedadg_discriminator.")}
    assert {method.tensor_group(k, False) for k in keys if k.startswith("fedadg_generator.")} == {"fedadg_generator"}
    # the projection is trained with the rest of D (the code's optimizer takes every parameter of D)
    assert any(q is model.fedadg_discriminator.projection.weight for q in model.fedadg_discriminator.parameters())
    assert model.fedadg_discriminator.projection.bias is None


def test_fedadg_warms_up_on_plain_cross_entropy_first():
    method, model, ref_model, x, y = _adg("training.local_steps=10", "method.warmup_fraction=0.3")
    seen = []
    method.adversarial_step = lambda *a: seen.append(len(seen)) or torch.tensor(0.0)  # count adversarial steps
    res = method.local_train(model, lambda: iter([(x, y)] * 10), _ctx())
    assert res.steps == 10 and len(seen) == 7


def test_fedadg_warm_up_by_epochs_is_its_fraction_of_epochs_times_batches_per_epoch():
    # no local_steps: the round's budget is 2 epochs x ceil(10 samples / batch 4) = 6 steps, the warm-up
    # round(0.5 x 6) = 3 of them (the mutation audit's survivor: 2 + 3 = 5 steps would warm up for 2)
    method, model, _, x, y = _adg("training.local_epochs=2", "training.batch_size=4", "method.warmup_fraction=0.5")
    assert method.training.local_steps is None
    seen = []
    method.adversarial_step = lambda *a: seen.append(len(seen)) or torch.tensor(0.0)
    ctx = ClientContext(client_id=0, round=1, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                        num_samples=10)
    res = method.local_train(model, lambda: iter([(x, y)] * 6), ctx)
    assert res.steps == 6 and len(seen) == 3


def test_fedgma_defaults_and_bounds_are_the_references():
    # FedDG-Benchmark's PACS configuration: mask_threshold 0.4, step_size 1.0 (a changed default changes a table)
    p = build_method(tiny_cfg("method.name=fedgma"), 3).p
    assert (p.mask_threshold, p.step_size) == (0.4, 1.0)
    for bad in ("method.mask_threshold=1.5", "method.mask_threshold=-0.1", "method.step_size=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            tiny_cfg("method.name=fedgma", bad)


def test_fedgma_with_one_client_moves_every_coordinate_fully():
    method = build_method(tiny_cfg("method.name=fedgma", "method.mask_threshold=1.0"), 4)
    method.param_keys = ["a"]
    prev, average = {"a": np.array([1.0, 2.0], np.float32)}, {"a": np.array([1.5, 1.0], np.float32)}
    out = method.assemble_global(1, [_update(2, 5, [1, -1])], average, prev, {})
    np.testing.assert_allclose(out["a"], [1.5, 1.0])  # one vote is full agreement: A = 1 >= tau


@pytest.mark.parametrize("name,defaults", [
    ("fedsam", {"rho": 0.05}),
    ("fediir", {"penalty": 1e-3, "ema": 0.95, "grad_batches": 0}),
    ("fedadg", {"alpha": 0.85, "label_smoothing": 0.1, "label_scale": 0.7, "warmup_fraction": 0.3, "adv_lr": 0.007,
                "noise_dim": 2048, "gen_hidden": 4096, "rp_size": 1024, "disc_hidden": 1024}),
])
def test_defaults_are_the_reference_codes(name, defaults):
    # each default is its docstring's source's value: a changed one silently changes every table with the method
    p = build_method(tiny_cfg(f"method.name={name}"), 3).p
    assert {k: getattr(p, k) for k in defaults} == defaults


def test_fedsam_accepts_bf16_refuses_a_negative_radius_and_skips_unused_parameters():
    assert tiny_cfg("method.name=fedsam", "training.precision=bf16").training.precision == "bf16"
    with pytest.raises(ConfigError, match="rho"):
        tiny_cfg("method.name=fedsam", "method.rho=-0.01")
    # a parameter the loss never reaches has no gradient: it is neither perturbed nor stepped
    method = build_method(tiny_cfg("method.name=fedsam", "training.momentum=0", "training.weight_decay=0"), 3)
    model = nn.Sequential(_linear())
    model.unused = nn.Parameter(torch.ones(3))
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y)
    method.local_train(model, lambda: iter([(x, y)]), _ctx())
    assert torch.equal(model.unused.detach(), torch.ones(3))
    assert not torch.equal(model[0].weight.detach(), torch.tensor(W0, dtype=torch.float32))


def test_fediir_without_prepared_gradients_keeps_the_mean_so_far():
    method = build_method(tiny_cfg("method.name=fediir"), 3)
    assert method.server_payloads(1, [0, 1], {}, None, {}, {}) == {}
    state = {"fediir_grad_mean": np.array([0.5, -0.25])}
    out = method.server_payloads(2, [1], state, None, {}, {})
    np.testing.assert_array_equal(out[1]["fediir_grad_mean"], np.array([0.5, -0.25], np.float32))
    model, ctx = _split_model(), _ctx()
    method.round_start(model, ctx)  # no payload: the average starts at 0
    assert all(float(g.abs().sum()) == 0.0 for g in ctx.scratch["g_bar"])


def test_fediir_refuses_parameters_out_of_their_range():
    for bad in ("method.penalty=-0.1", "method.ema=1.0", "method.ema=-0.1", "method.grad_batches=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            tiny_cfg("method.name=fediir", bad)


def test_fediir_one_batch_in_all_is_its_own_mean_and_grad_batches_zero_means_every_sample():
    method = build_method(tiny_cfg("method.name=fediir", "method.ema=0.5", "method.grad_batches=0"), 3)
    assert method.p.grad_batches == 0
    out = method.server_payloads(1, [0], {}, None, {}, {0: {"fediir_grad_sum": np.array([0.8, -0.4]),
                                                            "fediir_batches": np.array([1])}})
    np.testing.assert_allclose(out[0]["fediir_grad_mean"], [0.4, -0.2])  # (1 - ema) x the one batch's gradient
