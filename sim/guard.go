package sim

import (
	"fmt"
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

// CheckLoopback parses a target URL and refuses anything but this machine:
// a load test must never hit someone else's server by a typo.
func CheckLoopback(target string) (*url.URL, error) {
	u, err := url.Parse(target)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("--target %q: want http://HOST:PORT or https://HOST:PORT", target)
	}
	h := u.Hostname()
	ip := net.ParseIP(h)
	if !(strings.EqualFold(h, "localhost") || (ip != nil && ip.IsLoopback())) {
		return nil, fmt.Errorf("refusing --target %s: the swarm only loads this machine (127.0.0.0/8, ::1 or localhost)", target)
	}
	return u, nil
}
