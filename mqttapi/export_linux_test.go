//go:build linux

package mqttapi

// BreakPoller closes the listener's epoll set from under its poller,
// so that its next wait fails as a failing epoll_wait would; false: b has
// no poller.
func BreakPoller(b *Broker) bool {
	if b.dev.poll == nil {
		return false
	}
	return b.dev.poll.ep.Close() == nil
}
