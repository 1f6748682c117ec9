package kafka

import (
	"fmt"
	"net"
	"net/url"
	"strings"
)

// Target is where the log lives: the bootstrap brokers and the topic, and
// how a client reaches them (Auth).
type Target struct {
	Brokers []string
	Topic   string
	Auth    Auth
}

// String is the target as a --log URL (without Auth: it holds no secret).
func (t Target) String() string {
	return "kafka://" + strings.Join(t.Brokers, ",") + "/" + t.Topic
}

// ParseURL reads a --log value: kafka://host:port[,host:port…]/topic.
func ParseURL(s string) (Target, error) {
	bad := func(why string) (Target, error) {
		return Target{}, fmt.Errorf("--log %q: %s; want kafka://host:9092,host:9092,host:9092/topic", s, why)
	}
	rest, ok := strings.CutPrefix(s, "kafka://")
	if !ok {
		return bad("not a kafka:// URL")
	}
	hosts, topic, ok := strings.Cut(rest, "/")
	if !ok || topic == "" {
		return bad("no topic after the brokers")
	}
	if strings.ContainsAny(topic, "/?#") || len(topic) > 249 {
		return bad("topic must be one name of at most 249 characters")
	}
	if t, err := url.PathUnescape(topic); err != nil || t != topic {
		return bad("topic must not be escaped")
	}
	for _, c := range topic {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return bad(fmt.Sprintf("topic may hold only letters, digits, '.', '_' and '-', got %q", c))
		}
	}
	var t Target
	for _, h := range strings.Split(hosts, ",") {
		if _, port, err := net.SplitHostPort(h); err != nil || port == "" {
			return bad(fmt.Sprintf("broker %q is not host:port", h))
		}
		t.Brokers = append(t.Brokers, h)
	}
	t.Topic = topic
	return t, nil
}
