//go:build !linux

package mqttapi

import (
	"net"
	"syscall"
)

// poller is Linux's (poll_linux.go); elsewhere every connection keeps a
// reading goroutine of its own.
type poller struct{}

func newPoller(func(error, int)) (*poller, error) { return nil, nil }

func (p *poller) close()            {}
func (p *poller) add(*devConn) bool { return false }
func (p *poller) remove(*devConn)   {}

// rawConnOf: raw reads and writes are Linux's; elsewhere every write goes
// through the net.Conn.
func rawConnOf(net.Conn) syscall.RawConn { return nil }

func writeNow(syscall.RawConn, []byte) (int, error) { return 0, nil }
