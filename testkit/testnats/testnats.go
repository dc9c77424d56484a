// Package testnats runs embedded NATS servers for tests: one server, or an
// in-process JetStream cluster of three, on random loopback ports, each
// with its JetStream store in the test's t.TempDir. Any node can be stopped
// and restarted on its own ports and store, so a test can drive a client
// through a server's loss and return.
//
// It is test-only support: import it from _test.go files only (its own
// test fails when non-test code imports it). It imports testing and the
// whole nats-server, which no kvrelay binary should link.
//
// Every wait here is on a condition (listeners bound, routes up, a meta
// leader elected and known to every node), bounded by Timeout, so the
// helpers hold on a loaded machine without sleeping for a guessed time.
package testnats

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvrelay/kvrelay/internal/freeport"
)

// Timeout bounds each wait of the helpers (a server's listeners, a
// cluster's routes and meta leader). Generous: a 3-node JetStream cluster
// under -race on a busy 2-core machine takes seconds to elect.
const Timeout = 30 * time.Second

// Node is one embedded nats-server. Stop and Restart it in place: a
// restarted node keeps its client and cluster ports, its name and its
// JetStream store.
type Node struct {
	t    testing.TB
	name string
	opts *server.Options // the template each (re)start clones

	mu  sync.Mutex
	srv *server.Server // nil while stopped
}

// Config configures Start.
type Config struct {
	// Port is the client port; 0 picks a random one (kept across restarts).
	Port int
	// NoJetStream starts the server without JetStream (core NATS only).
	NoJetStream bool
	// MaxPayload is the server's max_payload; 0 keeps NATS's default (1 MiB).
	MaxPayload int32
	// ConfigFile loads a nats-server configuration file (accounts,
	// users, permissions, TLS) as the server's options; the test's own
	// host, port, store and logging then replace the file's.
	ConfigFile string
	// Configure, when set, changes the options last (auth, TLS).
	Configure func(*server.Options)
}

// Start runs one server on 127.0.0.1 and stops it when the test ends.
func Start(t testing.TB, cfg Config) *Node {
	t.Helper()
	port := cfg.Port
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts := baseOptions(t, "single")
	if cfg.ConfigFile != "" {
		fromFile, err := server.ProcessConfigFile(cfg.ConfigFile)
		if err != nil {
			t.Fatalf("testnats: %s: %v", cfg.ConfigFile, err)
		}
		fromFile.ServerName, fromFile.Host, fromFile.NoLog, fromFile.NoSigs = opts.ServerName, opts.Host, opts.NoLog, opts.NoSigs
		fromFile.StoreDir, fromFile.JetStreamMaxMemory, fromFile.JetStreamMaxStore = opts.StoreDir, opts.JetStreamMaxMemory, opts.JetStreamMaxStore
		opts = fromFile
	}
	opts.Port = port
	opts.JetStream = !cfg.NoJetStream
	if cfg.MaxPayload > 0 {
		opts.MaxPayload = cfg.MaxPayload
	}
	if cfg.Configure != nil {
		cfg.Configure(opts)
	}
	n := &Node{t: t, name: "single", opts: opts}
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Stop)
	return n
}

func baseOptions(t testing.TB, name string) *server.Options {
	return &server.Options{
		ServerName: name,
		Host:       "127.0.0.1",
		NoLog:      true,
		NoSigs:     true,
		StoreDir:   t.TempDir(),
		// Bounds, not reservations: the store stays small, and a cluster
		// of three must not each claim most of the machine's memory.
		JetStreamMaxMemory: 64 << 20,
		JetStreamMaxStore:  256 << 20,
	}
}

// start (re)starts the server from the template and, the first time,
// pins the random client port it got so a restart reuses it.
func (n *Node) start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return fmt.Errorf("testnats: %s already running", n.name)
	}
	srv, err := server.NewServer(n.opts.Clone())
	if err != nil {
		return fmt.Errorf("testnats: %s: %w", n.name, err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(Timeout) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return fmt.Errorf("testnats: %s not ready for connections within %v (a port taken meanwhile?)", n.name, Timeout)
	}
	if n.opts.Port == server.RANDOM_PORT {
		n.opts.Port = srv.Addr().(*net.TCPAddr).Port
	}
	n.srv = srv
	return nil
}

// Name is the node's server name (n0, n1, n2 in a cluster).
func (n *Node) Name() string { return n.name }

// URL is the node's client URL (nats://127.0.0.1:PORT), stopped or not.
func (n *Node) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port) }

// Running reports whether the node is up.
func (n *Node) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv != nil
}

// Server is the running server (nil while stopped), for the server's own
// introspection (Connz, JetStreamIsLeader, …).
func (n *Node) Server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Stop shuts the node down and waits until it is down: its clients and
// routes see their connections close. Stopping a stopped node does nothing.
func (n *Node) Stop() {
	n.mu.Lock()
	srv := n.srv
	n.srv = nil
	n.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Restart starts a stopped node again on the same ports and store. It
// fails the test if the node is running or does not come up.
func (n *Node) Restart() {
	n.t.Helper()
	if err := n.start(); err != nil {
		n.t.Fatal(err)
	}
}

// ClientsNamed counts the node's client connections whose name starts with
// prefix (0 while stopped): which node a named client is connected to.
func (n *Node) ClientsNamed(prefix string) int {
	srv := n.Server()
	if srv == nil {
		return 0
	}
	cz, err := srv.Connz(&server.ConnzOptions{Limit: 1 << 16})
	if err != nil {
		return 0
	}
	count := 0
	for _, c := range cz.Conns {
		if strings.HasPrefix(c.Name, prefix) {
			count++
		}
	}
	return count
}

// Cluster is an in-process JetStream cluster, each node routed to every
// other.
type Cluster struct {
	t     testing.TB
	Name  string
	Nodes []*Node
}

// StartCluster runs a JetStream cluster of size nodes (3 for a quorum that
// survives one loss) and waits until it is Ready. It stops every node when
// the test ends.
func StartCluster(t testing.TB, size int) *Cluster {
	t.Helper()
	if size < 2 {
		t.Fatalf("testnats: a cluster of %d nodes", size)
	}
	var lastErr error
	// A cluster port is chosen free before its server binds it, so another
	// process can take it meanwhile; a fresh set of ports is tried then.
	for range 3 {
		c, err := startCluster(t, size)
		if err == nil {
			return c
		}
		lastErr = err
	}
	t.Fatal(lastErr)
	return nil
}

func startCluster(t testing.TB, size int) (*Cluster, error) {
	// JetStream clustering needs routes configured up front (no node may
	// only wait to be dialled), so every node's cluster port is known
	// before any starts.
	clusterPorts := make([]int, size)
	for i := range clusterPorts {
		p, err := freeport.Range(1)
		if err != nil {
			return nil, err
		}
		clusterPorts[i] = p
	}
	c := &Cluster{t: t, Name: "kvrelay-test"}
	for i := range size {
		name := fmt.Sprintf("n%d", i)
		opts := baseOptions(t, name)
		opts.Port = server.RANDOM_PORT
		opts.JetStream = true
		opts.Cluster = server.ClusterOpts{Name: c.Name, Host: "127.0.0.1", Port: clusterPorts[i]}
		for j, p := range clusterPorts {
			if j != i {
				opts.Routes = append(opts.Routes, &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", p)})
			}
		}
		c.Nodes = append(c.Nodes, &Node{t: t, name: name, opts: opts})
	}
	for _, n := range c.Nodes {
		if err := n.start(); err != nil {
			c.stopAll()
			return nil, err
		}
	}
	if err := c.waitReady(); err != nil {
		c.stopAll()
		return nil, err
	}
	t.Cleanup(c.stopAll)
	return c, nil
}

func (c *Cluster) stopAll() {
	for _, n := range c.Nodes {
		n.Stop()
	}
}

// URLs lists every node's client URL, comma-separated, as a client given
// the whole cluster takes it (kvrelay gateway --nats, nats.Connect).
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL()
	}
	return strings.Join(urls, ",")
}

// MetaLeader is the running node that leads the JetStream meta group, or
// nil while none does.
func (c *Cluster) MetaLeader() *Node {
	for _, n := range c.Nodes {
		if srv := n.Server(); srv != nil && srv.JetStreamIsLeader() {
			return n
		}
	}
	return nil
}

// Ready waits until the running nodes form a cluster: each routed to every
// other running node, one meta leader that sees them all online, and every
// node current with it. It fails the test after Timeout.
func (c *Cluster) Ready() {
	c.t.Helper()
	if err := c.waitReady(); err != nil {
		c.t.Fatal(err)
	}
}

func (c *Cluster) waitReady() error {
	deadline := time.Now().Add(Timeout)
	for {
		problem := c.notReady()
		if problem == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testnats: cluster not ready within %v: %s", Timeout, problem)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// notReady names what the cluster still lacks, "" when nothing.
func (c *Cluster) notReady() string {
	var running []*server.Server
	for _, n := range c.Nodes {
		if srv := n.Server(); srv != nil {
			running = append(running, srv)
		}
	}
	if len(running) <= len(c.Nodes)/2 {
		return fmt.Sprintf("only %d of %d nodes running: no quorum", len(running), len(c.Nodes))
	}
	var leader *server.Server
	for _, srv := range running {
		if got := srv.NumRemotes(); got != len(running)-1 {
			return fmt.Sprintf("%s routed to %d of %d other nodes", srv.Name(), got, len(running)-1)
		}
		if !srv.JetStreamIsClustered() {
			return srv.Name() + ": JetStream not clustered yet"
		}
		if srv.JetStreamIsLeader() {
			leader = srv
		}
	}
	if leader == nil {
		return "no meta leader"
	}
	for _, srv := range running {
		if !srv.JetStreamIsCurrent() {
			return srv.Name() + " not current with the meta leader"
		}
	}
	// The leader counts a peer online once it has the peer's stats, and
	// places a new stream's replicas only on online peers.
	if got := len(leader.JetStreamClusterPeers()); got != len(running) {
		return fmt.Sprintf("meta leader %s sees %d of %d nodes online", leader.Name(), got, len(running))
	}
	return ""
}
