"""DGCNN (Wang et al. 2019), the point-cloud network of the paper's experiments (random weights, for
structure): four EdgeConv layers — k-NN graph from pairwise distances (TopK), neighbour features by
Gather, edge features [x_j − x_i, x_i], 1×1 Conv-BN-LeakyReLU, max over neighbours — whose outputs are
concatenated, a 1-D 1×1 conv to 1024 channels, global max and mean pooling, and an MLP classifier.
Input ``points`` (batch, 3, N)."""

from __future__ import annotations

import torch
from torch import nn

POINTS = 256
NEIGHBOURS = 16


def knn(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, N, k) of each point's k nearest points (itself included) in feature space."""
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    square = torch.sum(x**2, dim=1, keepdim=True)
    return (-square - inner - square.transpose(2, 1)).topk(k=k, dim=-1)[1]


def edge_features(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B, 2C, N, k): [x_j − x_i, x_i] over each point's k neighbours j."""
    b, c, n = x.shape
    idx = (knn(x, k) + torch.arange(b).view(-1, 1, 1) * n).view(-1)
    points = x.transpose(2, 1).contiguous()
    neighbours = points.view(b * n, -1)[idx, :].view(b, n, k, c)
    centre = points.view(b, n, 1, c).expand(-1, -1, k, -1)
    return torch.cat((neighbours - centre, centre), dim=3).permute(0, 3, 1, 2).contiguous()


class DGCNN(nn.Module):
    def __init__(self, classes: int = 40, k: int = NEIGHBOURS, widths: tuple[int, ...] = (64, 64, 128, 256),
                 emb: int = 1024) -> None:
        super().__init__()
        self.k = k
        self.edge = nn.ModuleList()
        c_in = 3
        for c in widths:
            self.edge.append(nn.Sequential(nn.Conv2d(2 * c_in, c, 1, bias=False), nn.BatchNorm2d(c), nn.LeakyReLU(0.2)))
            c_in = c
        self.conv5 = nn.Sequential(nn.Conv1d(sum(widths), emb, 1, bias=False), nn.BatchNorm1d(emb), nn.LeakyReLU(0.2))
        self.mlp = nn.Sequential(nn.Linear(2 * emb, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2),
                                 nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = []
        for edge in self.edge:
            x = edge(edge_features(x, self.k)).max(dim=-1)[0]
            features.append(x)
        x = self.conv5(torch.cat(features, dim=1))
        return self.mlp(torch.cat((x.amax(dim=-1), x.mean(dim=-1)), dim=1))


def dgcnn() -> DGCNN:
    return DGCNN()
