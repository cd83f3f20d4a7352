r"""Writes notebooks/vit_from_scratch.ipynb from the cells below, executed.

  python notebooks/build_notebook.py            # write and run (~5 min)
  python notebooks/build_notebook.py --no-run   # cells only, no outputs

The notebook is committed with its outputs, so it renders with its figures
where it is hosted; this script is how it is edited (change a cell here,
rebuild), and tests/test_notebook.py runs it from a clean state.
"""

import argparse
import os
import sys
import time

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "vit_from_scratch.ipynb")

CELLS = [
    ("markdown", """\
# A Vision Transformer from scratch, in JAX

*An Image is Worth 16x16 Words* (Dosovitskiy et al., 2020) cuts an image
into patches, turns each into a token, and lets a plain Transformer encoder
read them. This notebook walks through that on the real library, `vit_jax`:
the patches, the tokens, one encoder block's attention, the whole model,
training on Fashion-MNIST for three minutes on a laptop CPU,
evaluating it, looking at its attention, the paper's Figure 7, and opening
the trained model in PyTorch (timm) with the same predictions."""),
    ("code", """\
# Install (Colab, or any machine without vit_jax yet).
try:
    import vit_jax
except ImportError:
    %pip install -q "vit_jax[tools,prepare]"
"""),
    ("code", """\
from vit_jax.runtime import host
host.default_xla_flags()  # vit_jax's measured XLA:CPU settings, before JAX starts

import os, tempfile, json
import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
from IPython.display import Image, display

import vit_jax
from vit_jax import config as config_lib
from vit_jax.data import augment, datasets
from vit_jax.inspection import figure7, introspect, tools
print("jax", jax.__version__, "on", jax.devices())
summary = {}  # the numbers tests/test_notebook.py checks
"""),
    ("markdown", """\
## The data

Fashion-MNIST: 28x28 grayscale garments in 10 classes. vit_jax reads the
raw files (`apt-get install dataset-fashion-mnist` on Debian/Ubuntu) or,
failing that, downloads it through TFDS."""),
    ("code", """\
config = config_lib.base_config("ViT-Mini/4")
config.dataset = "fashion_mnist"
data = datasets.load(config)
print(data.source)
print("train", data.train_images.shape, data.train_images.dtype,
      "| test", data.test_images.shape, "| classes:", data.class_names)
fig, axes = plt.subplots(1, 8, figsize=(12, 2))
for axis, image, label in zip(axes, data.train_images, data.train_labels):
    axis.imshow(image[..., 0], cmap="gray"); axis.set_title(data.class_names[label], fontsize=8); axis.axis("off")
plt.show()
"""),
    ("markdown", """\
## 16x16 words: cutting an image into patches

The paper's models see 224x224 images as 14x14 patches of 16x16 pixels. A
28x28 garment is small, so this notebook uses 4x4 patches: a 7x7 grid of
49 patches, each a "word" of 4x4x1 = 16 numbers."""),
    ("code", """\
image, patch = data.test_images[0], config.model.patch_size
grid = image.shape[0] // patch
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4.2))
left.imshow(image[..., 0], cmap="gray")
for k in range(1, grid):
    left.axhline(k * patch - 0.5, color="red", lw=0.8); left.axvline(k * patch - 0.5, color="red", lw=0.8)
left.set_title(f"{data.class_names[data.test_labels[0]]}: a {grid}x{grid} grid of {patch}x{patch} patches")
patches = image[..., 0].reshape(grid, patch, grid, patch).transpose(0, 2, 1, 3).reshape(grid * grid, patch, patch)
canvas = np.ones((grid * (patch + 1), grid * (patch + 1))) * 255
for k, p in enumerate(patches):
    r, c = divmod(k, grid)
    canvas[r * (patch + 1):r * (patch + 1) + patch, c * (patch + 1):c * (patch + 1) + patch] = p
right.imshow(canvas, cmap="gray"); right.set_title(f"the {grid * grid} patches, in reading order")
for axis in (left, right): axis.set_xticks([]); axis.set_yticks([])
plt.show()
"""),
    ("markdown", """\
## Patches to tokens

The model (`vit_jax/model/vit.py`) embeds every patch with one convolution
whose kernel and stride are the patch size (the same as a linear map of
each flattened patch), flattens the grid into a sequence, prepends a
learnable class token and adds a learned position embedding per token.
`introspect.shape_trace` reads the shape after every stage from the real
modules' outputs."""),
    ("code", """\
model = vit_jax.build_model(config.model, num_classes=10)
inputs = augment.normalize(jnp.asarray(data.test_images[:1]), *data.channel_stats())
params = model.init(jax.random.PRNGKey(0), inputs)["params"]
print(introspect.format_table(introspect.shape_trace(model, params, inputs), ("stage", "output shape")))
"""),
    ("markdown", """\
## The whole model: ViT-B/16 and the small one

Parameters per module and FLOPs per image (XLA's count), first for the
paper's ViT-B/16 on 224x224 ImageNet images (86 M parameters), then for
the 0.8 M-parameter model trained below."""),
    ("code", """\
big = config_lib.base_config("ViT-B/16")
big.dataset = "synthetic"; big.synthetic.image_size = 224; big.synthetic.channels = 3
print(tools.summary(big, num_classes=1000).split("\\n\\n", 2)[2])  # parameters and FLOPs
print()
print(tools.summary(config, num_classes=10).split("\\n\\n", 2)[2])
"""),
    ("markdown", """\
## Training

`train_and_evaluate` runs the jit-compiled train step with AdamW, a
warm-up and cosine decay, checkpoints to `workdir`, and evaluates on the
10,000 test images. `time_budget_minutes` plans the number of steps to fit
the wall time (compilation and evaluation included): three minutes here,
about one pass over the 60,000 training images on a 2-core laptop CPU,
which reaches roughly 75-80%. The 60-minute recipe
(`configs/vit_fashion_mnist_60min.py`) reaches 94%."""),
    ("code", """\
workdir = tempfile.mkdtemp(prefix="vit_notebook_")
config.time_budget_minutes = 3.0
config.num_epochs = 3
config.warmup_epochs = 0.2
config.eval_batch_size = 1000
config.log_every_steps = 50
config.random_flip = True  # garments look alike mirrored
config.crop_padding = 0    # random crops pay only over many epochs
metrics = vit_jax.train_and_evaluate(config, workdir)
summary["test_accuracy"] = metrics["accuracy"]
print(f"test accuracy {metrics['accuracy']:.4f}")
"""),
    ("code", """\
display(Image(tools.curves(workdir, os.path.join(workdir, "curves.png"))))
"""),
    ("markdown", """\
## Evaluation: per-class report, confusion matrix, confident mistakes"""),
    ("code", """\
trained = tools.load_trained(config, workdir)
figures = os.path.join(workdir, "figures"); os.makedirs(figures, exist_ok=True)
print(tools.evaluation_report(config, trained, figures))
display(Image(os.path.join(figures, "confusion_matrix.png")))
display(Image(os.path.join(figures, "confident_mistakes.png")))
"""),
    ("markdown", """\
## One encoder block: what each head attends to

Each block normalises its tokens, lets every token attend to every other in
each head, and adds an MLP. Below: the first block's attention of one test
image, as the class token's attention over the 49 patches, per head."""),
    ("code", """\
images = data.test_images[:1]
weights = introspect.attention_weights(trained.model, trained.params,
                                       augment.normalize(jnp.asarray(images), trained.mean, trained.std))
print(f"{len(weights)} layers of attention probabilities, each {weights[0].shape} (batch, heads, tokens, tokens)")
heads = weights[0].shape[1]
fig, axes = plt.subplots(1, heads + 1, figsize=(2.4 * (heads + 1), 2.6))
axes[0].imshow(images[0, ..., 0], cmap="gray"); axes[0].set_title("image")
for h in range(heads):
    cls_attention = np.asarray(introspect.class_token_attention(weights, 0, h))[0].reshape(grid, grid)
    axes[h + 1].imshow(cls_attention, cmap="inferno"); axes[h + 1].set_title(f"layer 1, head {h + 1}")
for axis in axes: axis.axis("off")
plt.show()
"""),
    ("markdown", """\
## Attention maps and rollout over test images

Attention rollout (Abnar & Zuidema, 2020) multiplies the layers' attention
(plus the residual) to see which patches reach the class token through the
whole network; beside it, each head of the last layer."""),
    ("code", """\
images, titles = tools.attention_inputs(config, trained, [], num_images=4)
display(Image(tools.attention_figure(trained, images, os.path.join(figures, "attention.png"), titles)))
"""),
    ("markdown", """\
## The paper's Figure 7

Centre: each patch's position embedding compared (cosine similarity) with
every other's, drawn on the grid. Nothing told the model the patches form
a 2-D grid; whatever row and column structure appears was learned (the
paper's ViT-L/32 shows it clearly after pre-training; three minutes of
training show its beginnings). Right: each head's mean attention distance,
the ViT's receptive field, against depth."""),
    ("code", """\
similarity_png, distance_png = tools.figure7(config, trained, figures, num_images=64)
display(Image(similarity_png)); display(Image(distance_png))
embeddings = figure7.patch_position_embeddings(trained.params, trained.model, trained.grid)
similarity = figure7.position_embedding_similarity(embeddings, trained.grid)
distances = figure7.patch_distances(trained.grid, patch).reshape(similarity.shape)
near, far = similarity[(distances > 0) & (distances <= patch)].mean(), similarity[distances >= 4 * patch].mean()
summary.update(neighbour_similarity=float(near), distant_similarity=float(far))
print(f"mean similarity to adjacent patches {near:.3f}, to patches 4+ apart {far:.3f}")
"""),
    ("markdown", """\
## Into PyTorch: the same model in timm

`export_state_dict` writes the trained parameters with timm's names (or
torchvision's); loaded into timm's `VisionTransformer` of the same shape,
it gives the same logits. (`python -m vit_jax.checkpoints.convert` does the
same from the command line.) Needs the `torch` extra."""),
    ("code", """\
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, via timm
try:
    import torch, timm
except ImportError:
    torch = None
    print("PyTorch/timm not installed: pip install 'vit_jax[torch]' to run this cell")
if torch is not None:
    from vit_jax.checkpoints import torch_state_dicts
    m = trained.model
    state = torch_state_dicts.export_state_dict(trained.params, "timm")
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=28, patch_size=m.patch_size, in_chans=1, embed_dim=m.hidden_size,
        depth=m.num_layers, num_heads=m.num_heads, mlp_ratio=m.mlp_dim / m.hidden_size,
        act_layer="gelu_tanh" if m.approximate_gelu else "gelu",  # this variant's GELU
        num_classes=10).eval()
    theirs.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    images = data.test_images[:16]
    x = augment.normalize(jnp.asarray(images), trained.mean, trained.std)
    with torch.no_grad():
        torch_logits = theirs(torch.from_numpy(np.array(x)).permute(0, 3, 1, 2)).numpy()
    jax_logits = np.asarray(trained.model.apply({"params": trained.params}, x))
    summary["timm_max_abs_logit_diff"] = float(np.abs(torch_logits - jax_logits).max())
    print("same predictions:", (torch_logits.argmax(1) == jax_logits.argmax(1)).all(),
          f"| max |logit difference| {summary['timm_max_abs_logit_diff']:.2e}")
"""),
    ("code", """\
print("NOTEBOOK_SUMMARY " + json.dumps(summary))
"""),
]


def build() -> nbformat.NotebookNode:
  notebook = nbformat.v4.new_notebook()
  notebook.metadata.update(
      kernelspec={"name": "python3", "display_name": "Python 3",
                  "language": "python"},
      language_info={"name": "python"})
  for kind, source in CELLS:
    make = (nbformat.v4.new_markdown_cell if kind == "markdown" else
            nbformat.v4.new_code_cell)
    notebook.cells.append(make(source.rstrip("\n")))
  return notebook


def execute(notebook: nbformat.NotebookNode, timeout: int = 900,
            cwd: str = HERE) -> nbformat.NotebookNode:
  """Runs every cell in a fresh kernel (nbclient), outputs kept."""
  import nbclient  # pylint: disable=g-import-not-at-top
  client = nbclient.NotebookClient(notebook, timeout=timeout,
                                   kernel_name="python3",
                                   resources={"metadata": {"path": cwd}})
  client.execute()
  return notebook


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--no-run", action="store_true")
  args = parser.parse_args()
  notebook = build()
  if not args.no_run:
    start = time.perf_counter()
    execute(notebook)
    print(f"executed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
  nbformat.write(notebook, NOTEBOOK)
  print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
  main()
