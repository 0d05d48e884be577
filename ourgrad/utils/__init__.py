"""torch.utils's namespace: `ourgrad.utils.data` holds TensorDataset and DataLoader (ourgrad/utils/data.py)."""
from ourgrad.utils import data

__all__ = ["data"]
