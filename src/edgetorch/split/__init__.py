"""BottleFit split computing: bottleneck injection, two-stage training, 8-bit payloads, runtime.

The few verbs a user needs are re-exported here (:func:`train_student` is the whole recipe that
``edgetorch split train`` runs; it returns a :class:`StudentRun`); the HTTP server (``edgetorch.split.server``),
the device client (``edgetorch.split.client``) and the clients that check a running server (``loadgen``, ``probe``,
``fuzz``, as ``edgetorch split probe`` runs them) are imported from their modules.

Example:
    >>> import torchvision, edgetorch.split as es
    >>> student = es.inject_bottleneck(torchvision.models.resnet18(num_classes=10), channels=12)
    >>> head, tail = es.split(student)
"""

from .artifact import load
from .bottlefit import BottleFitConfig, train_bottlefit
from .bottleneck import ACCEPTED_ARCHS, SPLIT_POINTS, BottleneckModel, inject_autoencoder, inject_bottleneck, split
from .evaluate import OffloadScore, SplitAccuracy, evaluate_split, file_offload
from .export import save
from .links import parse_link
from .losses import ghnd_loss, kd_loss
from .manifest import SplitArtifactError
from .onnx_head import load_onnx_head
from .payload import PayloadError, decode, encode, payload_size
from .plan import compare_deployments, measure_server
from .power import DeviceProfile, ServerProfile, load_profile, load_server
from .recipe import RecipeConfig, train_student
from .student import StudentEvaluation, StudentRun, load_trained
from .teacher import TeacherConfig, load_rgb, train_teacher
from .train import StageConfig, train_stage

__all__ = [
    "ACCEPTED_ARCHS",
    "BottleFitConfig",
    "BottleneckModel",
    "DeviceProfile",
    "OffloadScore",
    "PayloadError",
    "RecipeConfig",
    "SPLIT_POINTS",
    "ServerProfile",
    "SplitAccuracy",
    "SplitArtifactError",
    "StageConfig",
    "StudentEvaluation",
    "StudentRun",
    "TeacherConfig",
    "compare_deployments",
    "decode",
    "encode",
    "evaluate_split",
    "file_offload",
    "ghnd_loss",
    "inject_autoencoder",
    "inject_bottleneck",
    "kd_loss",
    "load",
    "load_onnx_head",
    "load_profile",
    "load_rgb",
    "load_server",
    "load_trained",
    "measure_server",
    "parse_link",
    "payload_size",
    "save",
    "split",
    "train_bottlefit",
    "train_stage",
    "train_student",
    "train_teacher",
]
