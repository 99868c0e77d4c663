"""Router training (torch) and its ONNX export, built node by node like the bundle's graphs.

A router maps features to P(the light token differs from the LLM's). The SLM router is R2R's
small MLP over the SLM's last hidden state and top-k log-probabilities; the n-gram router a
logistic regression over the lookup features. Both: inputs standardized with the training
split's statistics (folded into the graph), class-balanced BCE, early stopping on a split by
prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

ROUTER_OPSET = 21


@dataclass(frozen=True)
class TrainSettings:
    hidden_units: int = 64  # 0: logistic regression
    epochs: int = 60
    patience: int = 6
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    dropout: float = 0.1
    seed: int = 0


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    positive = positive.astype(bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class RouterNet(torch.nn.Module):
    def __init__(self, mean: np.ndarray, std: np.ndarray, hidden_units: int, dropout: float) -> None:
        super().__init__()
        features = len(mean)
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))
        if hidden_units:
            self.body = torch.nn.Sequential(torch.nn.Linear(features, hidden_units), torch.nn.ReLU(),
                                            torch.nn.Dropout(dropout), torch.nn.Linear(hidden_units, 1))
        else:
            self.body = torch.nn.Sequential(torch.nn.Linear(features, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, 1]."""
        return self.body((x - self.mean) / self.std)

    def probability(self, x: np.ndarray) -> np.ndarray:
        self.eval()
        with torch.no_grad():
            return torch.sigmoid(self(torch.as_tensor(np.asarray(x, np.float32))))[:, 0].numpy()


def train_router(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
                 settings: TrainSettings) -> tuple[RouterNet, float]:
    """The model with the best validation AUC (and that AUC)."""
    torch.manual_seed(settings.seed)
    x_train, x_val = np.asarray(x_train, np.float32), np.asarray(x_val, np.float32)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-3
    net = RouterNet(mean, std, settings.hidden_units, settings.dropout)
    positives = max(float(y_train.sum()), 1.0)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(y_train) - positives) / positives))
    optimizer = torch.optim.AdamW(net.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    x, y = torch.as_tensor(x_train), torch.as_tensor(y_train, dtype=torch.float32)[:, None]
    generator = torch.Generator().manual_seed(settings.seed)
    best, best_state, stale = -1.0, None, 0
    for _ in range(settings.epochs):
        net.train()
        for batch in torch.randperm(len(x), generator=generator).split(settings.batch_size):
            optimizer.zero_grad()
            loss_fn(net(x[batch]), y[batch]).backward()
            optimizer.step()
        auc = roc_auc(net.probability(x_val), y_val)
        auc = 0.0 if np.isnan(auc) else auc  # a one-class early-stopping split: keep the first epoch
        if auc > best + 1e-4:
            best, best_state, stale = auc, {k: v.clone() for k, v in net.state_dict().items()}, 0
        else:
            stale += 1
            if stale >= settings.patience:
                break
    net.load_state_dict(best_state)
    net.eval()
    return net, best


def router_onnx(net: RouterNet) -> bytes:
    """The router as a standard ONNX graph: features [N, F] -> probability [N, 1]."""
    linears = [m for m in net.body if isinstance(m, torch.nn.Linear)]
    inits = [numpy_helper.from_array(net.mean.numpy(), "mean"), numpy_helper.from_array(net.std.numpy(), "std")]
    nodes = [helper.make_node("Sub", ["features", "mean"], ["centered"], name="/router/center"),
             helper.make_node("Div", ["centered", "std"], ["x0"], name="/router/scale")]
    current = "x0"
    for i, linear in enumerate(linears):
        w, b = f"w{i}", f"b{i}"
        inits += [numpy_helper.from_array(linear.weight.detach().numpy().T.copy(), w),
                  numpy_helper.from_array(linear.bias.detach().numpy(), b)]
        nodes += [helper.make_node("MatMul", [current, w], [f"mm{i}"], name=f"/router/linear{i}/MatMul"),
                  helper.make_node("Add", [f"mm{i}", b], [f"z{i}"], name=f"/router/linear{i}/Add")]
        current = f"z{i}"
        if i < len(linears) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"r{i}"], name=f"/router/relu{i}"))
            current = f"r{i}"
    nodes.append(helper.make_node("Sigmoid", [current], ["probability"], name="/router/sigmoid"))
    features = len(net.mean)
    graph = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("features", TensorProto.FLOAT,
                                                                              ["N", features])],
                              [helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["N", 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ROUTER_OPSET)],
                              producer_name="edgeroute-calibrate")
    onnx.checker.check_model(model)
    return model.SerializeToString()
