"""An aggregation part from your own module: the norm-bounded mean (Sun, Kairouz,
Suresh, McMahan, "Can You Really Backdoor Federated Learning?", 2019, Sec. 4):
each client's update y_i - x_t is scaled down to L2 norm at most ``BOUND``
before the weighted mean, x_t + sum_i w_i clip(y_i - x_t) / sum_i w_i.
Registered under ``server.aggregator: norm_bounded`` when the module is imported
(``plugins: [my_aggregator]``)."""
import numpy as np

from rayfed_dg.engine.aggregation import Estimator, register_aggregator

BOUND = 1.0


@register_aggregator
class NormBounded(Estimator):
    name = "norm_bounded"
    sums = False  # it reads each upload whole (its norm), so uploads are not folded on the workers

    def estimate(self, u):
        floats = [k for k, v in u.x.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
        out, acc, wsum = dict(u.x), {k: np.zeros(np.shape(u.x[k])) for k in floats}, 0.0
        for c, y in u.uploads():  # in client order: the result does not depend on the arrival order
            delta = {k: np.asarray(y[k], np.float64) - u.x[k] for k in floats}
            norm = np.sqrt(sum(float((d * d).sum()) for d in delta.values()))
            scale = min(1.0, BOUND / norm) if norm > 0 else 1.0
            for k in floats:
                acc[k] += u.weights[c] * scale * delta[k]
            wsum += u.weights[c]
        for k in floats:
            out[k] = (u.x[k] + acc[k] / wsum).astype(np.asarray(u.x[k]).dtype)
        return out
