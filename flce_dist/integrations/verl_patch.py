"""Importing this module calls :func:`flce_dist.integrations.verl.patch`: the name to give verl's
external-module hooks, which import modules by name in every worker::

    actor_rollout_ref.model.external_lib=flce_dist.integrations.verl_patch   # HFModelConfig imports it
    VERL_USE_EXTERNAL_MODULES=flce_dist.integrations.verl_patch              # or: `import verl` imports it

Python caches imports: a second import does nothing (call ``patch()`` again after ``unpatch()``).
"""

from .verl import patch

PATCHED = patch()
