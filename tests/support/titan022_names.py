"""torchtitan 0.2.2's own MoE models (deepseek_v3 debugmodel, qwen3 debugmodel_moe) built on the
meta device: their state_dict names and shapes as JSON (``python titan022_names.py OUT.json``).

Runs in its own venv (``/work/venvs/titan022``: torch 2.13 + ``torchtitan==0.2.2 --no-deps`` +
torchdata, tyro, einops, tokenizers; ``.ci/install_titan022.sh``), never beside torchtitan 0.3.0.
0.2.2's data loading / tensorboard / triton MoE kernel modules are imported at module level and
stubbed here (not used to build a model); ``moe_impl``, read by 0.2.2's models from the job
config, gets its default.
"""
import json
import sys
import types

for n in ["datasets", "datasets.distributed", "torch.utils.tensorboard", "torchtitan.models.moe.kernels"]:
    m = types.ModuleType(n)
    m.__getattr__ = lambda attr: (_ for _ in ()).throw(AttributeError(attr)) if attr.startswith("__") else type(attr, (), {})
    sys.modules.setdefault(n, m)
import torch
out = {}
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.model.model import Qwen3Model
for name, cls, table, flavor in (("deepseek_v3", DeepSeekV3Model, deepseekv3_args, "debugmodel"),
                                 ("qwen3", Qwen3Model, qwen3_args, "debugmodel_moe")):
    args = table[flavor]
    if not hasattr(args, "moe_impl"):  # read by 0.2.2's model, set by its job config
        args.moe_impl = "standard"
    with torch.device("meta"):
        try:
            model = cls(args)
        except Exception as e:
            print(name, "does not build:", type(e).__name__, e)
            continue
    out[f"{name}/{flavor}"] = {k: list(v.shape) for k, v in model.state_dict().items()}
json.dump(out, open(sys.argv[1], "w"), indent=0)
print({k: len(v) for k, v in out.items()})
