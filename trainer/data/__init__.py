"""The loaders that feed a training step with static shapes, one module per job: the epoch's
shape (epochs), the device loader, the host loader, dataset items, the DataLoader workers that
read them and end with their rank (workers), the choice between the loaders (choice), real
data or its synthetic stand-in (sources), and whole documents packed into fixed-shape rows (packing). Both loaders yield the same
batches in the same order for a given seed, epoch and rank, so that choosing one never changes what
a run learns.
"""
from trainer.data.choice import choose_loader, make_loader
from trainer.data.device_loader import DeviceLoader
from trainer.data.epochs import StepShape, micro_slice
from trainer.data.host_loader import HostLoader, host_copy
from trainer.data.items import collate, extra_input_names, item_problem, read_every_item

__all__ = ["DeviceLoader", "HostLoader", "StepShape", "choose_loader", "collate", "extra_input_names", "host_copy",
           "item_problem", "make_loader", "micro_slice", "read_every_item"]
