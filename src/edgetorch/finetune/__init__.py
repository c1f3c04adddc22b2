"""Fine-tune a model on the user's images under a memory policy, or a memory budget.

Example:
    >>> from edgetorch.data import image_data  # doctest: +SKIP
    >>> from edgetorch.finetune import FinetuneConfig, finetune, start_model  # doctest: +SKIP
    >>> model, _ = start_model("torchvision:resnet18", 3, weights="resnet18.safetensors")  # doctest: +SKIP
    >>> data = image_data("photos", size=224, channels=3)  # doctest: +SKIP
    >>> finetune(model, data.train, data.val, FinetuneConfig(policy="bitmap"), "runs/photos")  # doctest: +SKIP

Or the whole command as one call (model, data, new classifier, memory plan, training):

    >>> from edgetorch.finetune import FinetuneJob, run_finetune  # doctest: +SKIP
    >>> run = run_finetune(FinetuneJob(model="zoo:cnn", data="photos", memory_budget="600MiB"))  # doctest: +SKIP
    >>> run.summary()["plan"]["within_budget"]  # doctest: +SKIP
    True
"""

from .model import SCOPES, classifier_name, replace_classifier, set_scope, start_model
from .run import OPTIMIZERS, SCHEDULES, FinetuneConfig, FinetuneResult, finetune, prepare, saved_run
from .workflow import FinetuneJob, FinetuneRun, NothingFits, run_finetune

__all__ = ["OPTIMIZERS", "SCHEDULES", "SCOPES", "FinetuneConfig", "FinetuneJob", "FinetuneResult", "FinetuneRun",
           "NothingFits", "classifier_name", "finetune", "prepare", "replace_classifier", "run_finetune", "saved_run",
           "set_scope", "start_model"]
