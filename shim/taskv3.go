package shim

import (
	"context"

	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/proto"
)

// taskV3Service is the Task API's v3 name. Its messages are the v2 ones
// field for field (containerd/api runtime/task/v3/shim.proto), so the v2
// service answers it; containerd 2.x speaks v3 to shims that announce it.
const taskV3Service = "containerd.task.v3.Task"

// method adapts a typed RPC handler to a ttrpc method.
func method[Req any, PReq interface {
	*Req
	proto.Message
}, Resp proto.Message](f func(context.Context, PReq) (Resp, error)) ttrpc.Method {
	return func(ctx context.Context, unmarshal func(any) error) (any, error) {
		req := PReq(new(Req))
		if err := unmarshal(req); err != nil {
			return nil, err
		}
		return f(ctx, req)
	}
}

// registerTaskV3 serves svc under the v3 Task API name as well.
func registerTaskV3(srv *ttrpc.Server, svc taskapi.TaskService) {
	srv.RegisterService(taskV3Service, &ttrpc.ServiceDesc{Methods: map[string]ttrpc.Method{
		"State":      method(svc.State),
		"Create":     method(svc.Create),
		"Start":      method(svc.Start),
		"Delete":     method(svc.Delete),
		"Pids":       method(svc.Pids),
		"Pause":      method(svc.Pause),
		"Resume":     method(svc.Resume),
		"Checkpoint": method(svc.Checkpoint),
		"Kill":       method(svc.Kill),
		"Exec":       method(svc.Exec),
		"ResizePty":  method(svc.ResizePty),
		"CloseIO":    method(svc.CloseIO),
		"Update":     method(svc.Update),
		"Wait":       method(svc.Wait),
		"Stats":      method(svc.Stats),
		"Connect":    method(svc.Connect),
		"Shutdown":   method(svc.Shutdown),
	}})
}
