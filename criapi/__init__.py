"""Generated Python bindings for CRI v1, Koordinator RuntimeHook v1alpha1, NRI v0.6.1 and ttRPC.

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules in this package are
generated from ``cri-api/criapi/*.proto`` by ``grpc_tools.protoc``; do not edit
them by hand. After changing a .proto file, regenerate from the repo root with::

    python scripts/gen_proto.py

and verify the committed code is up to date with ``python scripts/gen_proto.py --check``.

Modules:
    cri_v1_pb2, cri_v1_pb2_grpc                  -- package ``runtime.v1``
    hook_v1alpha1_pb2, hook_v1alpha1_pb2_grpc    -- package ``runtime.v1alpha1``
    nri_v1alpha1_pb2                             -- package ``nri.pkg.api.v1alpha1`` (NRI v0.6.1;
                                                    carried by ttRPC, runtimeproxy/nri/wire.py)
    ttrpc_pb2                                    -- package ``ttrpc`` (the ttRPC envelope)
"""
