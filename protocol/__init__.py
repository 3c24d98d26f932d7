"""Wire protocol: the gRPC service, its generated stubs, the tensor codec and safetensors files."""

from fedpar.protocol.codec import CodecError, ModelLayout, TensorAssembler, iter_chunks
from fedpar.protocol.tensorfile import load_tensors, save_tensors

__all__ = ["CodecError", "ModelLayout", "TensorAssembler", "iter_chunks", "load_tensors", "save_tensors"]
