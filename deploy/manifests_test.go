// Package deploy holds the deployment files (systemd unit, Kubernetes
// example, image builder); its test checks the Kubernetes manifests offline.
// kubeconform would need the Kubernetes JSON schemas from the network, and
// no Go module here ships them, so the checks below are structural plus
// what kvrelay itself knows (the engines' config rules).
package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/gateway/membership"
)

type object struct {
	APIVersion string                `yaml:"apiVersion"`
	Kind       string                `yaml:"kind"`
	Metadata   struct{ Name string } `yaml:"metadata"`
	Data       map[string]string     `yaml:"data"`
	Resources  []string              `yaml:"resources"`
	Spec       struct {
		ClusterIP string `yaml:"clusterIP"`
		Selector  struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
		Ports []struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort string `yaml:"targetPort"`
		} `yaml:"ports"`
		Template struct {
			Metadata struct {
				Labels map[string]string `yaml:"labels"`
			} `yaml:"metadata"`
			Spec struct {
				Containers []container `yaml:"containers"`
			} `yaml:"spec"`
		} `yaml:"template"`
	} `yaml:"spec"`
}

type container struct {
	Name    string   `yaml:"name"`
	Image   string   `yaml:"image"`
	Command []string `yaml:"command"`
	Args    []string `yaml:"args"`
	Env     []struct {
		Name      string `yaml:"name"`
		Value     string `yaml:"value"`
		ValueFrom *struct {
			ConfigMapKeyRef *struct{ Name, Key string } `yaml:"configMapKeyRef"`
		} `yaml:"valueFrom"`
	} `yaml:"env"`
	Ports []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	ReadinessProbe *struct {
		HTTPGet struct {
			Path string `yaml:"path"`
			Port string `yaml:"port"`
		} `yaml:"httpGet"`
	} `yaml:"readinessProbe"`
}

func load(t *testing.T, dir string) (kustomization object, objs []object) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &kustomization); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		if !slices.Contains(kustomization.Resources, filepath.Base(f)) {
			t.Errorf("%s is not listed in kustomization.yaml", f)
		}
	}
	for _, r := range kustomization.Resources {
		data, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatalf("kustomization resource: %v", err)
		}
		dec := yaml.NewDecoder(strings.NewReader(string(data)))
		dec.KnownFields(false)
		for {
			var o object
			if err := dec.Decode(&o); err != nil {
				if err.Error() == "EOF" {
					break
				}
				t.Fatalf("%s: %v", r, err)
			}
			if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
				t.Errorf("%s: an object lacks apiVersion, kind or metadata.name", r)
			}
			objs = append(objs, o)
		}
	}
	return kustomization, objs
}

var engineByName = map[string]engines.Engine{"vllm": vllm.Engine, "sglang": sglang.Engine, "tokenspeed": tokenspeed.Engine}

func TestKubernetesSidecarExample(t *testing.T) {
	_, objs := load(t, "k8s")
	configMaps := map[string]map[string]string{}
	for _, o := range objs {
		if o.Kind == "ConfigMap" {
			configMaps[o.Metadata.Name] = o.Data
		}
	}
	// The engines' pod; the gateway's Deployment and Service are checked
	// by TestKubernetesGatewayFollowsTheEngines.
	var deployments, services []object
	for _, o := range objs {
		switch {
		case o.Kind == "Deployment" && o.Metadata.Name != "gateway":
			deployments = append(deployments, o)
		case o.Kind == "Service" && o.Metadata.Name != "gateway":
			services = append(services, o)
		}
	}
	if len(deployments) != 1 {
		t.Fatalf("want one engines Deployment, got %d", len(deployments))
	}
	d := deployments[0]
	for k, v := range d.Spec.Selector.MatchLabels {
		if d.Spec.Template.Metadata.Labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod's labels", k, v)
		}
	}

	// The pod shares one network namespace: every port, declared or bound by
	// an engine's publisher, must be distinct.
	portOwner := map[int]string{}
	claim := func(port int, who string) {
		if other, dup := portOwner[port]; dup {
			t.Errorf("port %d is used by %s and by %s in one pod", port, other, who)
		}
		portOwner[port] = who
	}
	portNames := map[string]bool{}
	// kvConfigOf is the ConfigMap text a container's $(KV_EVENTS_CONFIG) holds.
	kvConfigOf := map[string]string{}
	roles := map[string]string{} // container -> "engine" or "relay"
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Image == "" {
			t.Errorf("container %s has no image", c.Name)
		}
		env := map[string]string{}
		for _, e := range c.Env {
			switch {
			case e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil:
				ref := e.ValueFrom.ConfigMapKeyRef
				v, ok := configMaps[ref.Name][ref.Key]
				if !ok {
					t.Errorf("container %s: env %s names ConfigMap %s key %s, which does not exist", c.Name, e.Name, ref.Name, ref.Key)
				}
				env[e.Name] = v
			default:
				env[e.Name] = e.Value
			}
		}
		for _, a := range append(slices.Clone(c.Command), c.Args...) {
			for _, m := range regexp.MustCompile(`\$\(([A-Z_]+)\)`).FindAllStringSubmatch(a, -1) {
				if _, ok := env[m[1]]; !ok {
					t.Errorf("container %s: argument %q uses $(%s), which it does not define", c.Name, a, m[1])
				}
			}
		}
		for _, p := range c.Ports {
			if len(p.Name) > 15 || portNames[p.Name] {
				t.Errorf("container %s: port name %q is too long or used twice", c.Name, p.Name)
			}
			portNames[p.Name] = true
			claim(p.ContainerPort, c.Name+" "+p.Name)
		}
		if c.ReadinessProbe != nil && !slices.ContainsFunc(c.Ports, func(p struct {
			Name          string `yaml:"name"`
			ContainerPort int    `yaml:"containerPort"`
		}) bool {
			return p.Name == c.ReadinessProbe.HTTPGet.Port
		}) {
			t.Errorf("container %s: the readiness probe's port %q is not one of its ports", c.Name, c.ReadinessProbe.HTTPGet.Port)
		}
		kvConfigOf[c.Name] = env["KV_EVENTS_CONFIG"]
		roles[c.Name] = "engine"
		if len(c.Args) > 0 && c.Args[0] == "serve" {
			roles[c.Name] = "relay"
		}
	}

	relays := 0
	for _, c := range d.Spec.Template.Spec.Containers {
		if roles[c.Name] != "relay" {
			continue
		}
		relays++
		flags := map[string]string{}
		for _, a := range c.Args[1:] {
			k, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			flags[k] = v
		}
		eng, ok := engineByName[flags["engine"]]
		if !ok {
			t.Errorf("container %s: --engine %q", c.Name, flags["engine"])
			continue
		}
		if flags["kv-events-config"] != "$(KV_EVENTS_CONFIG)" {
			t.Errorf("container %s: --kv-events-config must be the engine's own text, $(KV_EVENTS_CONFIG)", c.Name)
		}
		text := kvConfigOf[c.Name]
		// The same text reaches an engine container of the pod.
		shared := false
		for other, role := range roles {
			if role == "engine" && kvConfigOf[other] == text {
				shared = true
			}
		}
		if !shared {
			t.Errorf("container %s: no engine container gets the same --kv-events-config", c.Name)
		}
		kv, err := eng.ParseConfig(text)
		if err != nil || !kv.Enabled {
			t.Errorf("container %s: the engine config %s does not enable events: %v", c.Name, text, err)
			continue
		}
		obj, _, _ := engines.ParseConfigObject(text)
		if err := obj.CheckKeys(eng.ConfigKeys); err != nil {
			t.Errorf("container %s: %v", c.Name, err)
		}
		if err := engines.CheckEndpoints(kv, 1); err != nil {
			t.Errorf("container %s: %v", c.Name, err)
		}
		if !engines.PublisherBinds(kv.Endpoint) {
			t.Errorf("container %s: endpoint %s makes the engine connect, not bind", c.Name, kv.Endpoint)
		}
		eps, _ := engines.PublisherEndpoints(kv, 1)
		for _, ep := range eps {
			for _, e := range []string{ep.Live, ep.Replay} {
				if e == "" {
					continue
				}
				var port int
				if _, err := fmt.Sscanf(e[strings.LastIndex(e, ":")+1:], "%d", &port); err != nil {
					t.Fatalf("%s: %v", e, err)
				}
				claim(port, c.Name+"'s engine publisher "+e)
			}
		}
		for _, addr := range []string{flags["listen"], flags["metrics-listen"]} {
			var port int
			fmt.Sscanf(addr[strings.LastIndex(addr, ":")+1:], "%d", &port)
			if _, declared := portOwner[port]; !declared || !strings.HasPrefix(portOwner[port], c.Name+" ") {
				t.Errorf("container %s listens on %s but does not declare that port", c.Name, addr)
			}
		}
	}
	if relays == 0 {
		t.Fatal("no kvrelay container in the pod")
	}
	for _, s := range services {
		for _, p := range s.Spec.Ports {
			if !portNames[p.TargetPort] {
				t.Errorf("service %s port %s targets %q, which no container declares", s.Metadata.Name, p.Name, p.TargetPort)
			}
		}
	}
}

// TestKubernetesGatewayFollowsTheEngines: the gateway Deployment's
// --worker-dns names resolve through the engines' headless Service: each
// is the SRV name of one of its ports, that port's relay serves the
// engine the spec says, and the Service is headless and selects the
// engines' pods.
func TestKubernetesGatewayFollowsTheEngines(t *testing.T) {
	_, objs := load(t, "k8s")
	var gw, engines *object
	headless := map[string]*object{}
	for i := range objs {
		o := &objs[i]
		switch {
		case o.Kind == "Deployment" && o.Metadata.Name == "gateway":
			gw = o
		case o.Kind == "Deployment":
			engines = o
		case o.Kind == "Service" && o.Spec.ClusterIP == "None":
			headless[o.Metadata.Name] = o
		}
	}
	if gw == nil || engines == nil || len(headless) == 0 {
		t.Fatalf("want a gateway Deployment, an engines Deployment and a headless Service")
	}
	// The relay behind each port name, by its --engine.
	relayOf := map[string]string{}
	for _, c := range engines.Spec.Template.Spec.Containers {
		if len(c.Args) == 0 || c.Args[0] != "serve" {
			continue
		}
		var eng string
		for _, a := range c.Args {
			if v, ok := strings.CutPrefix(a, "--engine="); ok {
				eng = v
			}
		}
		for _, p := range c.Ports {
			relayOf[p.Name] = eng
		}
	}
	if len(gw.Spec.Template.Spec.Containers) != 1 {
		t.Fatal("want one gateway container")
	}
	c := gw.Spec.Template.Spec.Containers[0]
	if len(c.Args) == 0 || c.Args[0] != "gateway" {
		t.Fatalf("gateway container args %v", c.Args)
	}
	specs := 0
	for _, a := range c.Args {
		v, ok := strings.CutPrefix(a, "--worker-dns=")
		if !ok {
			continue
		}
		specs++
		sp, err := membership.ParseDNSSpec(v)
		if err != nil {
			t.Errorf("%s: %v", a, err)
			continue
		}
		// _<port>._tcp.<service>.$(POD_NAMESPACE).svc.cluster.local
		labels := strings.Split(sp.Name, ".")
		if !sp.SRV || len(labels) < 4 || labels[1] != "_tcp" || !strings.HasPrefix(labels[0], "_") {
			t.Errorf("%s: want srv+_<port name>._tcp.<headless service>…", a)
			continue
		}
		port, svcName := labels[0][1:], labels[2]
		svc := headless[svcName]
		if svc == nil {
			t.Errorf("%s: no headless Service %s", a, svcName)
			continue
		}
		for k, v := range svc.Spec.Selector.MatchLabels {
			if engines.Spec.Template.Metadata.Labels[k] != v {
				t.Errorf("%s: its Service's selector %s=%s misses the engines' pods", a, k, v)
			}
		}
		if !slices.ContainsFunc(svc.Spec.Ports, func(p struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort string `yaml:"targetPort"`
		}) bool {
			return p.Name == port
		}) {
			t.Errorf("%s: Service %s has no port %s", a, svcName, port)
		}
		if got := relayOf[port]; got != string(sp.Service) {
			t.Errorf("%s: port %s is the relay of %q, the spec says service=%s", a, port, got, sp.Service)
		}
		if strings.Contains(sp.Name, "$(POD_NAMESPACE)") && !slices.ContainsFunc(c.Env, func(e struct {
			Name      string `yaml:"name"`
			Value     string `yaml:"value"`
			ValueFrom *struct {
				ConfigMapKeyRef *struct{ Name, Key string } `yaml:"configMapKeyRef"`
			} `yaml:"valueFrom"`
		}) bool {
			return e.Name == "POD_NAMESPACE"
		}) {
			t.Errorf("%s uses $(POD_NAMESPACE), which the container does not define", a)
		}
	}
	if specs == 0 {
		t.Fatal("the gateway follows no DNS name")
	}
}
