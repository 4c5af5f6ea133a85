"""Recipes: what is trained (model, data, loss) and the loop that trains it.

Each recipe module exposes ``build(cfg, runtime) -> Recipe``; ``RECIPES`` maps the
``recipe.name`` in conf/recipe/*.yaml to it.
"""
from recipes import cifar10, gpt, mnist

RECIPES = {
    "mnist": mnist.build,
    "cifar10_resnet18": cifar10.build,
    "gpt_tiny": gpt.build,
}
