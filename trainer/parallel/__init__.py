"""How the model is parallel, decided once by the plan (parallelism: DDP's settings or FSDP2's),
FSDP2's sharding of a recipe's model (sharding), and the optimizer's step on local shards
(shard_optimizer). The one place in trainer/ that asks whether a model is sharded; checkpoints
ask the plan's ``Parallelism`` (trainer/checkpoint/choice.py).
"""
