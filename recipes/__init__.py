"""Recipes: what is trained (model, data, loss) and the loop that trains it.

Each recipe module exposes ``build(cfg, runtime) -> Recipe``; ``RECIPES`` maps the
``recipe.name`` in conf/recipe/*.yaml to it.
"""
from recipes import mnist

RECIPES = {
    "mnist": mnist.build,
}
