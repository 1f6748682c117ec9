//go:build !linux

package mqttapi

// poller is Linux's (poll_linux.go); elsewhere every connection keeps a
// reading goroutine of its own.
type poller struct{}

func newPoller(func(error)) (*poller, error) { return nil, nil }

func (p *poller) close()               {}
func (p *poller) add(*devConn) bool    { return false }
func (p *poller) rearm(*devConn) error { return nil }
func (p *poller) remove(*devConn)      {}
