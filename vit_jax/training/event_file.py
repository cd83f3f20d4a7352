"""TensorBoard event files of scalars, written without TensorFlow or
tensorboardX.

An event file is a sequence of records, each an `Event` protocol buffer in
a TFRecord frame: its length (uint64, little-endian), a masked CRC-32C of
those 8 bytes, the bytes, and their masked CRC-32C. Scalars need four
messages:

  Event      {1: wall_time double, 2: step int64, 3: file_version string,
              5: summary Summary, 7: session_log SessionLog}
  Summary    {1: value repeated Value}
  Value      {1: tag string, 2: simple_value float}
  SessionLog {1: status enum (START = 1)}

This module encodes those few fields itself: tensorboardX, which vit_jax used
before, imports PyTorch where it is installed, which cost every command
(`main.py`'s training and inspection modes alike) 2-3 s of start-up and
~600 MB of memory.
"""

import functools
import os
import socket
import struct
import time
from typing import Optional

_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, bit-reversed


@functools.cache
def _crc_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (_CASTAGNOLI if crc & 1 else 0)
    table.append(crc)
  return tuple(table)


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of data, as TFRecord frames use it."""
  table, crc = _crc_table(), 0xFFFFFFFF
  for byte in data:
    crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masking of the CRC (rotated right by 15, plus a constant),
  so that a CRC stored inside CRC'd data does not weaken the check."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_frame(payload: bytes) -> bytes:
  length = struct.pack("<Q", len(payload))
  return (length + struct.pack("<I", masked_crc32c(length)) + payload +
          struct.pack("<I", masked_crc32c(payload)))


# ------------------------------------------------ protocol buffer encoding
def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64s as protobuf writes them
  out = bytearray()
  while value > 0x7F:
    out.append((value & 0x7F) | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _key(field, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, what: bytes) -> bytes:
  """An Event: its time and step, then `what` (one field of its oneof)."""
  return (_key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) +
          _varint(step) + what)


def scalar_event(tag: str, value: float, step: int,
                 wall_time: float) -> bytes:
  """An Event holding one scalar summary value."""
  summary_value = (_length_delimited(1, tag.encode()) +
                   _key(2, 5) + struct.pack("<f", value))
  return _event(wall_time, step,
                _length_delimited(5, _length_delimited(1, summary_value)))


def header_event(wall_time: float) -> bytes:
  """The first Event of a file, naming the format version."""
  return _event(wall_time, 0, _length_delimited(3, b"brain.Event:2"))


def session_start_event(wall_time: float, step: int) -> bytes:
  """SessionLog START at `step`: TensorBoard then hides the events of this
  run's files from step on that were written before it (a resumed run's
  steps that will be run again)."""
  return _event(wall_time, step,
                _length_delimited(7, _key(1, 0) + _varint(1)))


class EventFileWriter:
  """Appends scalars to a new `events.out.tfevents.<time>.<host>` file in
  logdir; `tensorboard --logdir LOGDIR` shows them.

  purge_step: when resuming, the first step that will be written again;
  events from earlier files at that step and later are hidden.
  """

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._file.write(tfrecord_frame(header_event(now)))
    if purge_step is not None:
      self._file.write(tfrecord_frame(session_start_event(now, purge_step)))
    self._file.flush()

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    event = scalar_event(tag, float(value), int(step), time.time())
    self._file.write(tfrecord_frame(event))

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    if not self._file.closed:
      self._file.close()
