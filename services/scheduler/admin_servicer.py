"""The Admin API (protos/tokenmill/v1/admin.proto): a thin adapter between protobuf and the
engine's adapter set (adapter_admin.py).

Authentication is the AuthInterceptor's (auth.py protects this service as it does Generation);
here a tenant must also be an admin. Without tenants (no --auth-tokens-file) every caller that
reaches the server may call it, as it may call Generation: that is loopback development, and a
deployment names its operators in the tokens file.
"""

from __future__ import annotations

from services.common.codec.step_codec import adapter_to_proto
from services.common.errors import PermissionDeniedError
from services.common.pb.tokenmill.v1 import admin_pb2, admin_pb2_grpc
from services.scheduler.adapter_admin import AdapterAdmin
from services.scheduler.auth import current_tenant


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, adapters: AdapterAdmin) -> None:
        self.adapters = adapters

    async def LoadAdapter(self, request: admin_pb2.AdminLoadAdapterRequest, context):
        _require_admin()
        return adapter_to_proto(await self.adapters.load(request.name, request.path, request.replace))

    async def UnloadAdapter(self, request: admin_pb2.AdminUnloadAdapterRequest, context):
        _require_admin()
        await self.adapters.unload(request.name)
        return admin_pb2.AdminUnloadAdapterResponse()

    async def ListAdapters(self, request, context):
        _require_admin()
        return admin_pb2.ListAdaptersResponse(adapters=[adapter_to_proto(a) for a in self.adapters.list()])


def _require_admin() -> None:
    tenant = current_tenant.get()
    if tenant is not None and not tenant.admin:
        raise PermissionDeniedError(f"tenant {tenant.name!r} may not call the Admin API; its entry in the auth "
                                    'tokens file needs "admin": true')
