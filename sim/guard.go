package sim

import (
	"net"
	"net/url"
	"strings"
)

// CheckTarget is CheckLoopback with the operator's exceptions: a target
// whose host is named in allow (exactly, as given to --allow-target) is
// accepted too. Nothing is allowed by pattern: a real deployment is loaded
// only by naming it.
func CheckTarget(target string, allow []string) (*url.URL, error) {
	if u, err := url.Parse(target); err == nil && u.Host != "" && (u.Scheme == "http" || u.Scheme == "https") && allowed(u.Hostname(), allow) {
		return u, nil
	}
	return CheckLoopback(target)
}

// CheckTargetAddr is CheckLoopbackAddr with the operator's exceptions (see
// CheckTarget).
func CheckTargetAddr(hostport string, allow []string) (string, error) {
	a := strings.TrimPrefix(strings.TrimPrefix(hostport, "tcp://"), "mqtt://")
	if h, port, err := net.SplitHostPort(a); err == nil && port != "" && allowed(h, allow) {
		return a, nil
	}
	return CheckLoopbackAddr(hostport)
}

func allowed(host string, allow []string) bool {
	for _, a := range allow {
		if a = strings.Trim(strings.TrimSpace(a), "[]"); a != "" && strings.EqualFold(a, host) {
			return true
		}
	}
	return false
}
