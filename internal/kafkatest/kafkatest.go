// Package kafkatest runs the three KRaft Kafka nodes of deploy/kafka for
// tests and make chaos, with deploy/kafka/kafka.sh exactly as an operator
// runs it: over TLS with SCRAM users and ACLs (KAFKA_TLS=0 in the
// environment: plain TCP, for comparison runs). Missing jars or Java fail
// with a message naming make deps, never a skip.
package kafkatest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kettlefleet/kettlefleet/kafka"
)

// The users kafka.sh makes: Admin a super user (the tools, tests' own
// clients), Front may produce, Writer may consume and commit.
const (
	Admin  = "admin"
	Front  = "front"
	Writer = "writer"
)

// Cluster is three running Kafka nodes.
type Cluster struct {
	Dir     string   // data and logs
	Brokers []string // host:port of each node
	TLS     bool     // SASL_SSL with users and ACLs (kafka.sh's KAFKA_TLS)
	env     []string
	script  string
}

// Options place the nodes; zero values take kafka.sh's defaults
// (127.0.46.1-3, port 9092).
type Options struct {
	Hosts []string
	Port  int
}

// Root is the repository root (where go.mod is), found from the working
// directory up.
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "deploy", "kafka", "kafka.sh")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("deploy/kafka/kafka.sh not found above the working directory")
		}
		dir = parent
	}
}

// Start formats and starts three nodes in dir and returns once each
// listens. Stop them with Stop.
func Start(dir string, o Options) (*Cluster, error) {
	root, err := Root()
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath("java"); err != nil {
		return nil, fmt.Errorf("kafka: no java on PATH: run make deps (deploy/deps/kafka.sh installs openjdk-17 and the Kafka jars)")
	}
	if m, _ := filepath.Glob(filepath.Join(root, ".deps", "kafka", "libs", "kafka_2.13-*.jar")); len(m) == 0 {
		return nil, fmt.Errorf("kafka: no jars in %s: run make deps (deploy/deps/kafka.sh fetches them)", filepath.Join(root, ".deps", "kafka", "libs"))
	}
	c := &Cluster{Dir: dir, script: filepath.Join(root, "deploy", "kafka", "kafka.sh"), env: os.Environ()}
	hosts := o.Hosts
	if len(hosts) == 0 {
		hosts = []string{"127.0.46.1", "127.0.46.2", "127.0.46.3"}
	}
	port := o.Port
	if port == 0 {
		port = 9092
	}
	c.env = append(c.env, "KAFKA_HOSTS="+strings.Join(hosts, " "), fmt.Sprintf("KAFKA_PORT=%d", port), fmt.Sprintf("KAFKA_CONTROLLER_PORT=%d", port+1))
	for _, h := range hosts {
		c.Brokers = append(c.Brokers, fmt.Sprintf("%s:%d", h, port))
	}
	if out, err := c.run(3*time.Minute, "start", dir); err != nil {
		c.Stop()
		return nil, fmt.Errorf("kafka.sh start: %v\n%s", err, out)
	}
	c.reaper()
	mode, _ := os.ReadFile(filepath.Join(dir, "tls-mode"))
	c.TLS = strings.TrimSpace(string(mode)) == "1"
	return c, nil
}

// Auth is how user (Admin, Front, Writer) reaches the nodes: their CA and
// the user's SCRAM password (nothing without TLS).
func (c *Cluster) Auth(user string) kafka.Auth {
	if !c.TLS {
		return kafka.Auth{}
	}
	pw, _ := os.ReadFile(c.PasswordFile(user))
	return kafka.Auth{CA: filepath.Join(c.Dir, "tls", "ca.crt"), User: user, Password: strings.TrimSpace(string(pw))}
}

// PasswordFile holds user's SCRAM password.
func (c *Cluster) PasswordFile(user string) string {
	return filepath.Join(c.Dir, "users", user+".password")
}

// Target is topic as user reaches it.
func (c *Cluster) Target(topic, user string) kafka.Target {
	return kafka.Target{Brokers: c.Brokers, Topic: topic, Auth: c.Auth(user)}
}

// Client is a client of the nodes as user, with extra options.
func (c *Cluster) Client(user string, extra ...kgo.Opt) (*kgo.Client, error) {
	return c.Target("", user).NewClient(extra...)
}

// Args are kettle serve's flags that make it reach the nodes as user
// (--log-ca, --log-user, --log-password-file; none without TLS).
func (c *Cluster) Args(user string) []string {
	if !c.TLS {
		return nil
	}
	return []string{"--log-ca", c.Auth(user).CA, "--log-user", user, "--log-password-file", c.PasswordFile(user)}
}

// reaper starts a watcher that stops the nodes once this process is gone
// however it ended (a test that panics never reaches Stop; the nodes run
// in their own session and would outlive it).
func (c *Cluster) reaper() {
	script := `while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" stop "$3"`
	cmd := exec.Command("bash", "-c", script, "reaper", fmt.Sprint(os.Getpid()), c.script, c.Dir)
	cmd.Env = c.env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err == nil {
		go cmd.Wait()
	}
}

func (c *Cluster) run(timeout time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.script, args...)
	cmd.Env = c.env
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// URL is a --log value for topic.
func (c *Cluster) URL(topic string) string {
	return "kafka://" + strings.Join(c.Brokers, ",") + "/" + topic
}

// Kill sends SIGKILL to node n (1-3).
func (c *Cluster) Kill(n int) error {
	out, err := c.run(30*time.Second, "kill", c.Dir, fmt.Sprint(n))
	if err != nil {
		return fmt.Errorf("kafka.sh kill %d: %v\n%s", n, err, out)
	}
	return nil
}

// Pause stops node n with SIGSTOP: its sockets stay open and neither
// answer nor refuse (Jepsen's pause; a hung machine).
func (c *Cluster) Pause(n int) error { return c.signal("pause", n) }

// Resume continues a paused node n (SIGCONT).
func (c *Cluster) Resume(n int) error { return c.signal("resume", n) }

func (c *Cluster) signal(verb string, n int) error {
	out, err := c.run(30*time.Second, verb, c.Dir, fmt.Sprint(n))
	if err != nil {
		return fmt.Errorf("kafka.sh %s %d: %v\n%s", verb, n, err, out)
	}
	return nil
}

// StartNode starts node n again.
func (c *Cluster) StartNode(n int) error {
	out, err := c.run(2*time.Minute, "start-node", c.Dir, fmt.Sprint(n))
	if err != nil {
		return fmt.Errorf("kafka.sh start-node %d: %v\n%s", n, err, out)
	}
	return nil
}

// Stop stops every node (SIGTERM, then SIGKILL).
func (c *Cluster) Stop() error {
	out, err := c.run(time.Minute, "stop", c.Dir)
	if err != nil {
		return fmt.Errorf("kafka.sh stop: %v\n%s", err, out)
	}
	return nil
}

// QuorumLeader is the node (1-3) that is the KRaft quorum's leader now: the
// active controller, whose loss costs a controller election on top of a
// broker's.
func (c *Cluster) QuorumLeader(ctx context.Context) (int, error) {
	cl, err := c.Client(Admin)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	req := kmsg.NewPtrDescribeQuorumRequest()
	t := kmsg.NewDescribeQuorumRequestTopic()
	t.Topic = "__cluster_metadata"
	p := kmsg.NewDescribeQuorumRequestTopicPartition()
	t.Partitions = append(t.Partitions, p)
	req.Topics = append(req.Topics, t)
	res, err := req.RequestWith(ctx, cl)
	if err != nil {
		return 0, fmt.Errorf("describe the KRaft quorum: %w", err)
	}
	if len(res.Topics) == 0 || len(res.Topics[0].Partitions) == 0 {
		return 0, fmt.Errorf("describe the KRaft quorum: empty answer")
	}
	return int(res.Topics[0].Partitions[0].LeaderID), nil
}
