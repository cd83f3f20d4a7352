"""The command line: `vit-jax`, `python -m vit_jax` and `python main.py`.

  vit-jax train --config=vit_tiny_fashion_mnist [--config.KEY=VALUE ...]
  vit-jax summary|curves|report|attention|figure7|predict --config=NAME ...
  python -m vit_jax train --config=configs/vit_tiny_cifar.py
  python main.py --config=configs/vit_tiny_cifar.py [--mode=MODE]

--config takes a file path, or the name of a config shipped in the
package (vit_jax/configs/NAME.py; a name that is not there lists them),
with an optional `:ARG` for configs that take one. The first word, if it
is a mode, is --mode. Any config key can be overridden on the command
line; running the same command again resumes from the latest checkpoint
in --workdir.

Several processes (hosts) run the same command, each with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or with
--multihost under SLURM, Open MPI or on a TPU pod slice (docs/scaling.md).

The modes besides train use the same config and workdir (figures go to
WORKDIR/figures unless --output_dir is given):
  summary    shape of every stage, parameters per module, FLOPs
  curves     training curves from WORKDIR/metrics.jsonl (PNG)
  report     test accuracy, per-class precision/recall, confusion matrix
             (text + PNG), most confident mistakes (PNG)
  attention  attention rollout and per-head maps over test images, or
             over --images files (PNG)
  figure7    the paper's Figure 7: position-embedding similarity and mean
             attention distance per head and layer (PNGs)
  predict    top-k classes of --images=a.png,b.jpg; with --attention,
             saves each with its attention map

This module imports only absl and ml_collections at the top: the input
pipeline's worker processes start with `spawn`, which imports the main
module again in each worker, and a worker needs none of JAX (~600 MB of
resident memory each).
"""

import glob
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configs")
_MODES = ("train", "summary", "curves", "report", "attention", "figure7",
          "predict")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A config file, or the name of a shipped config "
    "(vit_jax/configs/NAME.py), e.g. vit_tiny_fashion_mnist.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "Folder for checkpoints and metrics.jsonl; default runs/<config name>.")
_MODE = flags.DEFINE_enum("mode", "train", _MODES, "What to do.")
_IMAGES = flags.DEFINE_list("images", [], "Image files for predict/attention.")
_TOP_K = flags.DEFINE_integer("top_k", 3, "Classes to print per image.")
_ATTENTION = flags.DEFINE_bool(
    "attention", False, "predict: also save each image's attention maps.")
_NUM_IMAGES = flags.DEFINE_integer(
    "num_images", 6, "attention: test images to show (without --images); "
    "figure7: test images averaged over (64 if not given).")
_LAYER = flags.DEFINE_integer("layer", -1, "attention: layer of the "
                              "per-head maps (-1: the last).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None,
                                  "Where figures go; default WORKDIR/figures.")
# Several processes (hosts) in one run; see vit_jax/runtime/multihost.py.
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0, reachable by every process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "This process's index, 0..num_processes-1.")
_MULTIHOST = flags.DEFINE_bool(
    "multihost", False,
    "Detect the processes from SLURM, Open MPI, a TPU pod slice or "
    "Kubernetes.")


def _user_errors() -> tuple[type, ...]:
  """Errors whose message already says what went wrong and how to fix it:
  shown as they are, without a traceback."""
  # pylint: disable=g-import-not-at-top
  from vit_jax.checkpoints import orbax_checkpoints
  from vit_jax.data import datasets
  from vit_jax.model import vit
  from vit_jax.runtime import host_memory
  return (ValueError, FileNotFoundError, ImportError,
          datasets.DatasetUnavailableError,
          orbax_checkpoints.CheckpointRestoreError,
          orbax_checkpoints.WorkdirError, FloatingPointError,
          vit.ViTInputError, host_memory.HostMemoryError)


def _inspect(mode: str, config, workdir: str) -> None:
  """The non-training modes."""
  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib
  from vit_jax.inspection import tools
  if mode == "summary":
    print(tools.summary(config, config_lib.num_classes_of(config)))
    return
  output_dir = _OUTPUT_DIR.value or os.path.join(workdir, "figures")
  os.makedirs(output_dir, exist_ok=True)
  if mode == "curves":
    path = tools.curves(workdir, os.path.join(output_dir, "curves.png"))
    print(f"Wrote {path}")
    return
  trained = tools.load_trained(config, workdir)
  if mode == "report":
    print(tools.evaluation_report(config, trained, output_dir))
    print(f"Wrote report.txt, confusion_matrix.png and "
          f"confident_mistakes.png to {output_dir}")
  elif mode == "attention":
    images, titles = tools.attention_inputs(config, trained, _IMAGES.value,
                                            _NUM_IMAGES.value)
    path = tools.attention_figure(trained, images,
                                  os.path.join(output_dir, "attention.png"),
                                  titles, layer=_LAYER.value)
    print(f"Wrote {path}")
  elif mode == "figure7":
    count = _NUM_IMAGES.value if flags.FLAGS["num_images"].present else 64
    paths = tools.figure7(config, trained, output_dir, count)
    print("Wrote " + " and ".join(paths))
  elif mode == "predict":
    if not _IMAGES.value:
      raise ValueError("--mode=predict needs --images=a.png,b.jpg")
    results = tools.predict_files(
        trained, _IMAGES.value, _TOP_K.value,
        output_dir if _ATTENTION.value else None)
    for result in results:
      print(result["path"] + ": " + ", ".join(
          f"{name} {prob:.4f}" for name, prob in result["top"]))


def _check_config_loads() -> str:
  """The config file's path; exits with one line naming the problem (a
  missing file, with the shipped configs listed, or the file's own error)
  if the config cannot be loaded."""
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  if not os.path.isfile(path) and os.path.isfile(path.rpartition(":")[0]):
    path = path.rpartition(":")[0]  # FILE:ARG, ARG for get_config
  if not os.path.isfile(path):
    raise SystemExit(
        f"No config file {path!r}. The shipped configs: "
        + ", ".join(shipped_configs())
        + " (by name, or as configs/NAME.py in a clone); or give the path "
        "of a config file of your own.")
  try:
    _CONFIG.value  # pylint: disable=pointless-statement
  except Exception as e:  # pylint: disable=broad-except
    cause = e.__cause__ or e
    raise SystemExit(f"Could not load the config file {path}: "
                     f"{type(cause).__name__}: {cause}") from e
  return path


def shipped_configs() -> list[str]:
  """Names of the configs in the package, e.g. "vit_tiny_cifar"."""
  return sorted(os.path.splitext(os.path.basename(path))[0]
                for path in glob.glob(os.path.join(CONFIGS_DIR, "*.py"))
                if not path.endswith("__init__.py"))


def resolve_arguments(argv: list[str]) -> list[str]:
  """argv with a leading mode word made --mode=WORD and --config=NAME[:ARG]
  made the shipped config's path, when NAME is not a file here."""
  argv = list(argv)
  if len(argv) > 1 and argv[1] in _MODES:
    argv[1] = f"--mode={argv[1]}"
  for index, arg in enumerate(argv):
    if arg.startswith("--config="):
      value = arg.split("=", 1)[1]
      name, colon, rest = value.partition(":")
      if (not os.path.exists(name) and os.sep not in name
          and name.removesuffix(".py") in shipped_configs()):
        path = os.path.join(CONFIGS_DIR, name.removesuffix(".py") + ".py")
        argv[index] = f"--config={path}{colon}{rest}"
  return argv


def _run(argv):
  """Trains, or runs the --mode given, after absl has parsed the flags."""
  # pylint: disable=g-import-not-at-top
  import jax
  from vit_jax.runtime import host, multihost, preemption
  from vit_jax.training import loop
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config_path = _check_config_loads()
  workdir = _WORKDIR.value or os.path.join(
      "runs", os.path.splitext(os.path.basename(config_path))[0])
  # Orbax logs every save at INFO; keep the console to our progress lines.
  logging.set_verbosity(logging.WARNING)
  host.enable_compilation_cache()
  try:
    host.split_cpu_into_devices(  # before JAX starts
        _CONFIG.value.cpu_devices,
        (_CONFIG.value.batch_size, _CONFIG.value.eval_batch_size))
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                         _PROCESS_ID.value, auto=_MULTIHOST.value)
    if _MODE.value != "train":
      _inspect(_MODE.value, _CONFIG.value, workdir)
      return
    if jax.process_index() == 0:
      print(f"Config {config_path}, workdir {workdir}", flush=True)
    metrics = loop.train_and_evaluate(_CONFIG.value, workdir)
  except (preemption.Preempted, preemption.StoppedInSetUp) as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except _user_errors() as e:
    raise SystemExit(f"{type(e).__name__}: {e}") from e
  if jax.process_index() != 0:
    return
  print(f"Final test accuracy {metrics['accuracy']:.4f}, loss "
        f"{metrics['loss']:.4f} over {int(metrics['num_examples'])} images.",
        flush=True)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (a bad flag value: one line and the usage hint),
  and one line for a config file that fails while it loads (a syntax error,
  an exception in get_config) instead of a traceback."""
  try:
    return app.parse_flags_with_usage(argv)
  except Exception as e:  # pylint: disable=broad-except
    path = next((arg.split("=", 1)[1] for arg in argv
                 if arg.startswith("--config=")), "given with --config")
    sys.exit(f"Could not load the config file {path}: "
             f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> None:
  """The `vit-jax` console script; `python -m vit_jax` and main.py too."""
  # pylint: disable=g-import-not-at-top
  from vit_jax.runtime import host  # no JAX: before it starts
  host.reexec_with_fast_malloc()  # may restart the process, same arguments
  host.default_xla_flags()
  argv = resolve_arguments(sys.argv if argv is None else argv)
  # absl's --help prints the main module's docstring: the console script
  # has none, so every launcher shows this module's.
  sys.modules["__main__"].__doc__ = __doc__
  flags.mark_flags_as_required(["config"])
  app.run(_run, argv=argv, flags_parser=_parse_flags)
