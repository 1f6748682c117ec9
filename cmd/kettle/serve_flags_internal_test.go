package main

import (
	"flag"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/server"
)

// processFlags are kettle serve's flags that set the process, not a field
// of server.Config; their defaults live in serve_flags.go alone.
var processFlags = map[string]bool{"sample": true, "debug-addr": true, "gc-percent": true, "memory-limit-mb": true,
	"role": true, "log-format": true, "log-level": true}

// TestServeFlagDefaults: every flag of kettle serve that fills a field of
// server.Config has that field's server.DefaultConfig value as its
// default, so the library and the command cannot disagree. Which field a
// flag fills is found by setting it and seeing what changes.
func TestServeFlagDefaults(t *testing.T) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	o := newServeOptions(fs)
	registered := o.cfg // as the flags' registration left it: each field at its flag's default
	want := server.DefaultConfig()
	checked := 0
	fs.VisitAll(func(f *flag.Flag) {
		path := fieldOf(t, f, o, registered)
		o.cfg = registered
		switch {
		case strings.HasSuffix(f.Name, "-file") && secretFlags[strings.TrimSuffix(f.Name, "-file")]:
			// A secret's file twin fills its flag's field; the flag itself is checked.
			return
		case processFlags[f.Name] && path == "":
			return
		case processFlags[f.Name]:
			t.Errorf("--%s is listed as a process flag but fills Config.%s", f.Name, path)
			return
		case path == "":
			t.Errorf("--%s fills no field of server.Config (a process flag? list it in processFlags)", f.Name)
			return
		}
		checked++
		got, def := field(reflect.ValueOf(registered), path), field(reflect.ValueOf(want), path)
		if !reflect.DeepEqual(got.Interface(), def.Interface()) {
			t.Errorf("--%s defaults to %v, but server.DefaultConfig().%s is %v: take the flag's default from the Config", f.Name, got, path, def)
		}
	})
	if checked < 40 {
		t.Errorf("checked %d flags against server.DefaultConfig, want all of serve's (over 40)", checked)
	}
}

// fieldOf sets flag f to values until one changes o.cfg, and returns the
// path of the field that changed ("" if none did).
func fieldOf(t *testing.T, f *flag.Flag, o *serveOptions, base server.Config) string {
	t.Helper()
	for _, v := range []string{"9", "0.25", "7s", "30d", "false", "true", "sentinel:1", "192.0.2.7"} {
		o.cfg = base
		if f.Value.Set(v) != nil {
			continue
		}
		if paths := diff(reflect.ValueOf(base), reflect.ValueOf(o.cfg), ""); len(paths) > 0 {
			if len(paths) > 1 {
				t.Errorf("--%s=%s changed %d fields: %s", f.Name, v, len(paths), strings.Join(paths, ", "))
			}
			return paths[0]
		}
	}
	return ""
}

// diff lists the paths of the fields where a and b differ (functions are
// not compared).
func diff(a, b reflect.Value, path string) []string {
	if a.Kind() == reflect.Struct {
		var out []string
		for i := range a.NumField() {
			out = append(out, diff(a.Field(i), b.Field(i), strings.TrimPrefix(path+"."+a.Type().Field(i).Name, "."))...)
		}
		return out
	}
	if a.Kind() == reflect.Func || !a.CanInterface() {
		return nil
	}
	if !reflect.DeepEqual(a.Interface(), b.Interface()) {
		return []string{path}
	}
	return nil
}

// field is the field of v at a dotted path.
func field(v reflect.Value, path string) reflect.Value {
	for _, name := range strings.Split(path, ".") {
		v = v.FieldByName(name)
		if !v.IsValid() {
			panic(fmt.Sprintf("no field %s", path))
		}
	}
	return v
}
