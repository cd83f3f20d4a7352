"""What each instruction of a compiled XLA:CPU program is, for profiles.

`python benchmarks/cpu_profile.py` times the thunks of vit_jax's train
step (one per instruction of the program's entry computation); this reads
the program's HLO text (`compiled.as_text()`) to say which kind each one
is: which of a Dense layer's three products a dot (or a oneDNN product's
custom call) is, the attention kernel, the all-reduce, a copy, or an
elementwise fusion by the model scope (LayerNorm, MLP, attention) or
training scope (optimizer) in its op_name.
"""

import collections
import math
import re
from typing import NamedTuple, Optional

DENSE_KINDS = ("x.W (forward)", "dy.W^T (input gradients)",
               "x^T.dy (weight gradients)")
KIND_GROUPS = {  # summary name -> kinds, in the table's order
    "dense": DENSE_KINDS,
    "attention": ("attention kernel (C++)", "attention products (XLA)"),
    "elementwise": ("LayerNorm", "GELU and MLP bias",
                    "attention's q/k/v split and bias",
                    "embedding, head, residual adds", "loss and input"),
    "optimizer": ("optimizer (AdamW, gradient norm)",),
    "copies": ("copies and transposes", "bfloat16 transposes (C++)"),
    "all_reduce": ("all-reduce (waiting included)",),
    "other": ("other custom calls",),
}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter",
                "collective-permute", "all-to-all")


class Instruction(NamedTuple):
  """One HLO instruction of the compiled program's text."""
  name: str
  shape: str  # "f32[4160,576]{1,0}", or a tuple "(f32[...], ...)"
  opcode: str
  operands: tuple[str, ...]
  attributes: str  # the rest of the line: dims, calls=, metadata
  is_root: bool
  parameter_number: int  # N of parameter(N), else -1

  @property
  def op_name(self) -> str:
    found = re.search(r'op_name="([^"]*)"', self.attributes)
    return found.group(1) if found else ""

  @property
  def calls(self) -> str:
    found = re.search(r"calls=%?([\w.-]+)", self.attributes)
    return found.group(1) if found else ""


class HloModule(NamedTuple):
  """A compiled program's instructions, by name and by computation."""
  instructions: dict[str, Instruction]
  computations: dict[str, list[Instruction]]
  entry: str  # the entry computation's name: its instructions are thunks


def _split_shape(text: str) -> tuple[str, str]:
  """"(a, b) rest" or "f32[2]{0} rest" -> (shape, rest)."""
  if not text.startswith("("):
    shape, _, rest = text.partition(" ")
    return shape, rest
  depth = 0
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[:i + 1], text[i + 1:].lstrip()
  return text, ""


def parse_hlo(text: str) -> HloModule:
  """The instructions of an HLO module's text (`compiled.as_text()`)."""
  instructions, computations = {}, collections.defaultdict(list)
  computation = entry = ""
  for line in text.splitlines():
    header = re.match(r"(ENTRY )?%?([\w.-]+) .*\{\s*$", line)
    if header and not line.startswith(" "):
      computation = header.group(2)
      entry = computation if header.group(1) else entry
      continue
    found = re.match(r"\s+(ROOT )?%([\w.-]+) = (.*)$", line)
    if not found:
      continue
    shape, rest = _split_shape(found.group(3))
    call = re.match(r"([\w-]+)\((.*?)\)(.*)$", rest)
    if not call:
      continue
    number = call.group(2) if call.group(1) == "parameter" else "-1"
    instruction = Instruction(
        found.group(2), shape, call.group(1),
        tuple(re.findall(r"%([\w.-]+)", call.group(2))), call.group(3),
        bool(found.group(1)), int(number) if number.isdigit() else -1)
    instructions[instruction.name] = instruction
    computations[computation].append(instruction)
  return HloModule(instructions, dict(computations), entry)


def dims(shape: str) -> tuple[int, ...]:
  """f32[4160,576]{1,0} -> (4160, 576); the first array of a tuple."""
  arrays = all_dims(shape)
  return arrays[0] if arrays else ()


def all_dims(shape: str) -> list[tuple[int, ...]]:
  """Each array's dimensions in a shape or tuple of shapes."""
  return [tuple(int(d) for d in found.split(",") if d)
          for found in re.findall(r"\w+\[([\d,]*)\]", shape)]


def _attribute_dims(attributes: str, key: str) -> tuple[int, ...]:
  found = re.search(key + r"=\{([\d,]*)\}", attributes)
  return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def dot_flops(dot: Instruction, module: HloModule) -> float:
  """2 x output elements x contracted length of a dot instruction."""
  lhs = dims(module.instructions[dot.operands[0]].shape)
  contracted = math.prod(
      lhs[d] for d in _attribute_dims(dot.attributes, "lhs_contracting_dims"))
  return 2.0 * math.prod(dims(dot.shape)) * contracted


# vit_jax's oneDNN products (kernels/cpu_gemm.py): the Dense product each
# target computes, and the axis of its first operand that it contracts.
# Their bfloat16 variants are the same names ending in "Bf16".
_GEMM_TARGETS = {"VitGemm": (DENSE_KINDS[0], 2),
                 "VitGemmTransposedRight": (DENSE_KINDS[1], 2),
                 "VitGemmOverRows": (DENSE_KINDS[2], 1)}


def gemm_flops(call: Instruction, module: HloModule, contracted_axis: int
               ) -> float:
  """2 x output elements x contracted length of a oneDNN product's call,
  which contracts `contracted_axis` of its first operand (the elements of
  every result: x^T.dy writes the gradients of kernels side by side
  apart)."""
  first = dims(module.instructions[call.operands[0]].shape)
  return 2.0 * sum(math.prod(d) for d in all_dims(call.shape)) * (
      first[contracted_axis])


def _fused(instruction: Instruction, module: HloModule) -> list[Instruction]:
  """The instructions a fusion's computation runs (nested fusions too)."""
  inner = module.computations.get(instruction.calls, []) if (
      instruction.calls) else []
  return inner + [j for i in inner if i.opcode == "fusion"
                  for j in _fused(i, module)]


def _root(instruction: Instruction, module: HloModule) -> Instruction:
  """A fusion's root instruction; any other instruction itself."""
  return next((i for i in _fused(instruction, module) if i.is_root),
              instruction)


def _own_op_name(instruction: Instruction, module: HloModule) -> str:
  """The instruction's op_name, or its fusion root's: XLA's wrapped single
  ops keep theirs inside."""
  return instruction.op_name or _root(instruction, module).op_name


# Instructions that move or reshape data without arithmetic.
_VIEWS = frozenset(("parameter", "bitcast", "copy", "transpose", "convert",
                    "reshape", "concatenate", "slice", "broadcast",
                    "get-tuple-element", "tuple"))


def _reads_weights(name: str, module: HloModule,
                   fusion: Optional[Instruction] = None, depth: int = 8
                   ) -> bool:
  """Whether instruction `name` (inside `fusion`, if given) is the model's
  weights seen through copies, transposes and other views."""
  instruction = module.instructions[name]
  if depth == 0:
    return False
  if instruction.opcode == "parameter":
    if fusion is not None:  # the fusion's argument of that number
      return _reads_weights(fusion.operands[instruction.parameter_number],
                            module, None, depth - 1)
    return "params[" in instruction.op_name  # not the batch or AdamW's
  inner = _fused(instruction, module)
  if instruction.opcode == "fusion" and all(
      i.opcode in _VIEWS for i in inner):
    return any(_reads_weights(o, module, fusion, depth - 1)
               for o in instruction.operands)
  if instruction.opcode in _VIEWS:
    return any(_reads_weights(o, module, fusion, depth - 1)
               for o in instruction.operands)
  return False


def _dense_kind(dot: Instruction, op_name: str, module: HloModule,
                fusion: Optional[Instruction]) -> str:
  """Which of a Dense layer's products a dot is (`fusion`: the fusion it
  is inside, if it is)."""
  if _attribute_dims(dot.attributes, "lhs_batch_dims"):
    return "attention products (XLA)"
  if "transpose(" not in op_name:  # JAX's name for the backward pass
    return DENSE_KINDS[0]
  # The input gradient multiplies by the weights; the weight gradient
  # multiplies two activations.
  if any(_reads_weights(o, module, fusion) for o in dot.operands):
    return DENSE_KINDS[1]
  return DENSE_KINDS[2]


def _constant_operand(dot: Instruction, module: HloModule
                      ) -> Optional[Instruction]:
  """The operand of a dot that XLA makes from constants alone (a constant,
  or a fusion of no operands), if any."""
  for name in dot.operands:
    operand = module.instructions.get(name)
    if operand and (operand.opcode == "constant" or (
        operand.opcode == "fusion" and not operand.operands)):
      return operand
  return None


def _scope_kind(op_name: str) -> str:
  scopes = op_name.split("/")
  if "optimizer" in scopes:
    return "optimizer (AdamW, gradient norm)"
  if not any("VisionTransformer" in scope for scope in scopes):
    return "loss and input"
  if any(s.startswith(("LayerNorm", "encoder_norm")) for s in scopes):
    return "LayerNorm"
  if any(s.startswith("MlpBlock") for s in scopes):
    return "GELU and MLP bias"
  if any(s.startswith("MultiHeadDotProductAttention") for s in scopes):
    return "attention's q/k/v split and bias"
  return "embedding, head, residual adds"


def classify(instruction: Instruction, module: HloModule,
             reader_op_name: str = "") -> tuple[str, float]:
  """(kind, dense FLOPs) of one thunk's instruction. reader_op_name: the
  scope of a thunk that reads its result, for instructions XLA made
  without one (a reduction it split into a reduce-window)."""
  if instruction.opcode == "custom-call":
    target = re.search(r'custom_call_target="(\w+)"', instruction.attributes)
    target = target.group(1) if target else ""
    if target.startswith("VitAttention"):
      return "attention kernel (C++)", 0.0
    if target == "VitTransposeToBfloat16":  # matmuls' bf16 weight gradients
      return "bfloat16 transposes (C++)", 0.0
    if target.startswith("VitLayerNorm"):
      return "LayerNorm", 0.0
    if target.startswith("VitGelu"):
      return "GELU and MLP bias", 0.0
    # kernels/cpu_adamw.py, kernels/cpu_sum_of_squares.py
    if target in ("VitAdamW", "VitSumOfSquares"):
      return "optimizer (AdamW, gradient norm)", 0.0
    gemm = _GEMM_TARGETS.get(target.removesuffix("Bf16"))
    if gemm:
      product, contracted_axis = gemm
      return product, gemm_flops(instruction, module, contracted_axis)
    return "other custom calls", 0.0
  if instruction.opcode in _COLLECTIVES:
    return "all-reduce (waiting included)", 0.0
  inner = _fused(instruction, module)
  dots = [i for i in [instruction] + inner if i.opcode == "dot"]
  constant = _constant_operand(dots[0], module) if dots else None
  if constant:  # a sum as a product with ones (add_to_every_example's)
    return _scope_kind(constant.op_name or reader_op_name), 0.0
  if dots:
    kind = _dense_kind(
        dots[0], dots[0].op_name or instruction.op_name or reader_op_name,
        module, None if dots[0] is instruction else instruction)
    return kind, sum(dot_flops(dot, module) for dot in dots)
  if {instruction.opcode, _root(instruction, module).opcode} & {
      "copy", "transpose"}:
    return "copies and transposes", 0.0
  return _scope_kind(_own_op_name(instruction, module) or reader_op_name), 0.0


# Entry instructions that run no thunk: views of other buffers.
_NO_THUNK = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")


def thunk_consumers(module: HloModule) -> dict[str, set[str]]:
  """For each thunk of the entry computation, the thunks that read its
  output (through bitcasts and tuples, which run nothing)."""
  entry = {i.name: i for i in module.computations[module.entry]}

  def producers(name: str) -> set[str]:
    instruction = entry.get(name)
    if instruction is None or instruction.opcode in ("parameter", "constant"):
      return set()
    if instruction.opcode not in _NO_THUNK:
      return {name}
    return set().union(*(producers(o) for o in instruction.operands))

  consumers = collections.defaultdict(set)
  for instruction in entry.values():
    if instruction.opcode not in _NO_THUNK:
      for operand in instruction.operands:
        for producer in producers(operand):
          consumers[producer].add(instruction.name)
  return consumers


def reader_op_name(name: str, module: HloModule,
                   consumers: dict[str, set[str]], depth: int = 3) -> str:
  """The op_name of the nearest thunk downstream of `name` that has one."""
  for reader in sorted(consumers.get(name, ())):
    found = _own_op_name(module.instructions[reader], module)
    if not found and depth:
      found = reader_op_name(reader, module, consumers, depth - 1)
    if found:
      return found
  return ""
