"""Fine-tune a model on the user's images under a memory policy, or a memory budget.

Example:
    >>> from edgetorch.data import image_data  # doctest: +SKIP
    >>> from edgetorch.finetune import FinetuneConfig, finetune, start_model  # doctest: +SKIP
    >>> model, _ = start_model("torchvision:resnet18", 3, weights="resnet18.safetensors")  # doctest: +SKIP
    >>> data = image_data("photos", size=224, channels=3)  # doctest: +SKIP
    >>> finetune(model, data.train, data.val, FinetuneConfig(policy="bitmap"), "runs/photos")  # doctest: +SKIP
"""

from .model import SCOPES, classifier_name, replace_classifier, set_scope, start_model
from .run import OPTIMIZERS, SCHEDULES, FinetuneConfig, FinetuneResult, finetune, prepare

__all__ = ["OPTIMIZERS", "SCHEDULES", "SCOPES", "FinetuneConfig", "FinetuneResult", "classifier_name", "finetune",
           "prepare", "replace_classifier", "set_scope", "start_model"]
