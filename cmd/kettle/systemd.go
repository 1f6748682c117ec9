package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/coreos/go-systemd/v22/daemon"
)

// notifyReady tells systemd (a unit of Type=notify, deploy/systemd) that the
// listeners are open and the store answers, so units ordered after this one
// start only then. The returned stopping says STOPPING=1 (`systemctl status`
// shows "deactivating" while the queue drains); it runs at most once, when
// ctx ends or when called, whichever is first, and the caller calls it
// before its shutdown so that a quick exit does not outrun it. Without
// NOTIFY_SOCKET (not under systemd) both do nothing.
func notifyReady(ctx context.Context, what string) (stopping func()) {
	if _, err := daemon.SdNotify(false, daemon.SdNotifyReady+"\nSTATUS="+what); err != nil {
		fmt.Fprintf(os.Stderr, "kettle: telling systemd READY: %v\n", err)
	}
	once := sync.OnceFunc(func() { daemon.SdNotify(false, daemon.SdNotifyStopping+"\nSTATUS=draining") })
	context.AfterFunc(ctx, once)
	return once
}

// runUntilStopped is the life of a serving role after its start: READY=1
// with status, then until a signal ends ctx or r's listener fails (logged
// as failed), then STOPPING=1 and r's Close, which drains.
func runUntilStopped(ctx context.Context, r interface {
	Done() <-chan error
	Close() error
}, status, failed string, log *slog.Logger) error {
	stopping := notifyReady(ctx, status)
	select {
	case <-ctx.Done():
	case err := <-r.Done():
		if err != nil {
			log.Error(failed, "err", err)
		}
	}
	stopping()
	return r.Close()
}
